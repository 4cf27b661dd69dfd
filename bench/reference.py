#!/usr/bin/python3
"""The Python PyTorch reference for `trainer bench`: the same job, trained the plain PyTorch way.

    reference.py --config FILE [--set key=value ...] [--warmup N] [--steps N] [--out FILE.json]
                 [--peak-tflops X]
    reference.py ... --profile TRACE.json               # also a Chrome trace of the timed steps (torch.profiler)
    reference.py --describe --config FILE [--set ...]   # the model's state shapes and FLOPs, as JSON
    reference.py --print-defaults                       # this script's copy of the trainer's defaults

It reads the trainer's YAML config (defaults < file < --set, as trainer/config/config.h) and mirrors what bears
on speed:
  model      torchvision resnet18/34/50/101/152 (conv1 rebuilt for data.shape[0] != 3; without torchvision,
             or with --models builtin, this file's copy of them), or the CIFAR ResNet-20/32/56 below, which
             has models/resnet.cpp's structure (option A shortcuts); all with the trainer's parameter
             names. model.num_classes, zero_init_residual, channels_last (weights and inputs).
             gpt_tiny / gpt2: the GPT of models/gpt.cpp (GPT-2 names, pre-LN, causal attention as the
             trainer's automatic backend picks it: F.scaled_dot_product_attention where this torch has it
             (2.0+, as LibTorch 2.x has at::scaled_dot_product_attention), else models/attention.cpp's
             plain path written out; --attention plain forces the latter), tanh GELU, output tied to transformer.wte.weight,
             GPT-2 init); model.context (0 = the registered one), model.dropout; the vocabulary is
             --vocab-size, else model.vocab_size, else the registered model's (compare.py passes the
             trainer's, which for data.kind tokens is the token file's); model.vocab_multiple pads the
             token embedding's rows as models/gpt.h does (zero rows, their logits dropped before the loss);
             model.fused_bias false writes each Linear as the matmul and a separate add.
             llama_tiny / smollm2_135m / qwen2_5_0_5b / llama3_2_1b: transformers' own LlamaForCausalLM or
             Qwen2ForCausalLM of the registered shape (models/llama.h; random weights, transformers' init),
             attention through its sdpa path (--attention plain: eager), model.context and the vocabulary
             as for GPT: what a transformers user trains. Needs transformers (the 2.11 environment's).
  data       data.kind synthetic with an image model: a pool of 4 pre-generated batches of data.shape, uint8 noise
             normalized as the trainer's synthetic dataset (mean 0.5, std of uniform bytes), float32
             NCHW (pinned on a GPU), cycled. Fetching one is the "data wait" (about 0); the trainer's
             loader makes its batches in background threads instead.
             data.kind synthetic with a GPT: the trainer's own first 4 global batches, token for token
             (data/files/token_h5.h SyntheticTokens and TokenLoader's window order, repeated in numpy below).
             data.kind tokens: a pool of 4 batches of random windows of context + 1 token ids, uniform in
             [0, vocab) (the file is not read: the step's cost does not depend on the ids); inputs are
             the first T tokens, targets the last T, as the trainer's TokenLoader.
  step       zero_grad(set_to_none) -> per micro-batch: (copy to the device, channels_last) forward under
             torch.autocast when amp.enabled, cross entropy in fp32 summed and divided by the targets of
             the whole step (samples, or tokens: the token-weighted loss), label smoothing, backward
             (GradScaler for fp16) -> clip_grad_norm_ if optim.grad_clip > 0 -> optimizer step ->
             loss.item(): the one host sync per step, as the trainer.
  optimizer  torch.optim.SGD (momentum, nesterov, weight decay) or AdamW, no weight decay on tensors with
             fewer than 2 dims unless optim.decay_norm_and_bias; the trainer's LR schedule per step.
             optim.implementation as the trainer's: auto = what the trainer's auto picks (fused=True on
             CUDA with torch 2.4+, torch.optim's default foreach before, a loop over the tensors on the
             CPU), plain = foreach=False, foreach = foreach=True, fused = fused=True (an error where this
             torch has no fused kernel).
  threads    torch.set_num_threads(train.threads, or the CPUs this process may use: affinity and cgroup
             quota, as trainer/memory/resources.cpp's usable_cpus); cudnn.benchmark unless train.deterministic.
Not mirrored (an error if asked for): data.kind hdf5, memory.activation_checkpointing other than none.
Not needed here: train.snapshot (Python keeps no snapshot for a retried step); train.cuda_graph (the
reference runs eagerly, as a user's PyTorch loop does: the graph is the trainer's); train.fused_loss (PyTorch
has no fused cross-entropy: both values run F.cross_entropy on the float32 logits, the trainer's plain
loss, whose arithmetic the fused kernels keep); train.sample_every, sample_tokens, sample_prompt (text
samples while training, outside the timed steps' arithmetic).
--profile: torch.profiler (CPU ops, and CUDA kernels, copies and runtime calls on a GPU) over the timed
steps, each inside record_function("ProfilerStep#<step>") (1-based, as `trainer bench --profile` names
them), prepared one step ahead; exported with export_chrome_trace. bench/profile_table.py reads it.
Token jobs add tokens_per_s_median / tokens_per_s_aggregate (= samples/s x context), context and
vocab_size to the JSON, as `trainer bench` does.

The result JSON has the schema of `trainer bench` (docs/BENCHMARKS.md), with implementation "pytorch".
Works with Debian's torch 1.13 / torchvision 0.14 and with PyTorch 2.x on a GPU host.
"""
import argparse
import copy
import datetime
import json
import math
import os
import platform
import resource
import socket
import statistics
import sys
import time

import yaml

from hostinfo import cpu_model

# The trainer's defaults (trainer/config/config.h, Config{}), every key. tests/test_bench.cpp checks that this
# copy equals the trainer's, key for key.
DEFAULTS = {
    "model": {"name": "resnet20", "num_classes": 10, "zero_init_residual": False, "channels_last": False,
              "init_from": "", "init_skip": [], "context": 0, "vocab_size": 0, "vocab_multiple": 1,
              "fused_bias": True, "dropout": 0.0, "hf_config": "", "param_dtype": "float32",
              "lora": {"rank": 0, "alpha": 8.0, "dropout": 0.0, "targets": [], "use_rslora": False},
              "lora_init_from": ""},
    "data": {"kind": "hdf5", "train": "datasets/fmnist/train.h5", "test": "datasets/fmnist/test.h5",
             "in_memory": True, "check_timeout_s": 30.0, "shape": [3, 224, 224], "synthetic_size": 10000,
             "workers": 0, "prefetch": 2, "crop_padding": 0, "hflip": False, "normalize": True,
             # training-only augmentations; the reference runs none of them
             "auto_augment": "none", "randaugment_ops": 2, "randaugment_magnitude": 9, "random_erasing": 0.0,
             # stored pixels as uint8 batches, normalized on the device; the reference sends float32 batches
             "uint8_batches": "auto",
             # the next step's batch fetched and copied on a side stream during this step; the reference
             # copies each batch on the compute stream at its step, as a plain PyTorch loop does
             "fetch_ahead": "auto",
             # the JPEG kinds (packed_images, image_folder); the reference runs synthetic images only
             "size": 224, "eval_size": 0, "scale": [0.08, 1.0], "ratio": [3.0 / 4.0, 4.0 / 3.0], "crop_pct": 0.875,
             "max_image_pixels": 100000000},
    "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4,
              "decay_norm_and_bias": False, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "grad_clip": 0.0,
              "lamb_max_grad_norm": 1.0, "trust_clip": False, "always_adapt": False, "implementation": "auto",
              "state_dtype": "float32", "stochastic_rounding": False},
    "schedule": {"name": "cosine", "warmup_steps": 0, "warmup_epochs": 0.0, "min_lr": 0.0, "milestones": [],
                 "gamma": 0.1},
    "train": {"global_batch": 128, "micro_batch": 0, "steps": 0, "epochs": 0.0, "eval_every": 0,
              "eval_batch": 500, "eval_batches": 0, "label_smoothing": 0.0, "device": "auto", "threads": 0,
              "deterministic": False, "snapshot": "batched", "cuda_graph": "auto", "fused_loss": True,
              "sample_every": 0, "sample_tokens": 64, "sample_prompt": "",
              "loss": "cross_entropy", "bce_target_threshold": 0.0, "bce_sum_classes": False,
              "mixup_alpha": 0.0, "cutmix_alpha": 0.0, "mix_prob": 1.0, "mix_switch_prob": 0.5,
              "mix_mode": "batch", "ema_decay": 0.0, "ema_warmup": False, "ema_every": 1},
    "amp": {"enabled": False, "dtype": "bf16", "scaler": "auto", "init_scale": 65536.0, "growth_factor": 2.0,
            "backoff_factor": 0.5, "growth_interval": 2000},
    "memory": {"limit": "none", "auto_margin": -1.0, "auto_reserve": "0", "curve": "", "min_micro_batch": 1,
               "activation_checkpointing": "none", "checkpoint_every_k": 2, "ladder_checkpointing": True,
               "grow_after": 50, "headroom": 0.25, "ladder_sizes": "any", "auto_search": "auto",
               "cudnn_policy": "off", "cudnn_benchmark_limit": 0, "cudnn_empty_cache": True,
               "state": "fixed"},
    "checkpoint": {"every_steps": 0, "every_seconds": 0.0, "keep_last": 3, "async": True,
                   "max_failures": 3, "final": True},
    "dist": {"backend": "auto", "timeout_s": 600.0, "bucket_mb": 25.0, "shard": "none"},
    "log": {"every": 20, "level": "info", "http_port": 0, "http_host": "127.0.0.1", "tensorboard": False,
            "mlflow": "", "mlflow_experiment": ""},
    "seed": 0,
}

SCHEMA = "trainer-bench/1"
POOL_BATCHES = 4
MODELS = "auto"  # --models: auto (torchvision when importable) | builtin
ATTENTION = "auto"  # --attention: auto (fused where torch has it, as the trainer) | plain
VOCAB_SIZE = 0   # --vocab-size: 0 = the registered GPT's

# The registered GPTs (models/gpt.h: gpt2(), gpt_tiny()).
GPTS = {
    "gpt2": dict(vocab_size=50257, context=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt_tiny": dict(vocab_size=256, context=128, n_layer=4, n_head=4, n_embd=128),
}


# The registered Llama-family shapes (models/llama.h: llama_tiny(), smollm2_135m(), llama3_2_1b(),
# qwen2_5_0_5b()), in transformers' config keys; "arch" names the transformers class that computes it.
LLAMAS = {
    "llama_tiny": dict(arch="LlamaForCausalLM", vocab_size=256, context=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, hidden_size=128, intermediate_size=352,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True),
    "smollm2_135m": dict(arch="LlamaForCausalLM", vocab_size=49152, context=8192, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "llama3_2_1b": dict(arch="LlamaForCausalLM", vocab_size=128256, context=131072, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, hidden_size=2048, head_dim=64,
                        intermediate_size=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen2_5_0_5b": dict(arch="Qwen2ForCausalLM", vocab_size=151936, context=32768, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, hidden_size=896, intermediate_size=4864,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
}


class ConfigError(Exception):
    pass


# ---- config ---------------------------------------------------------------------------------------

def coerce(value, default, key, source):
    """`value` as the type of the trainer's default for `key`. PyYAML reads YAML 1.1 (where `1e-4` is a
    string and `yes` a bool) and yaml-cpp YAML 1.2, so numbers written as text are converted here."""
    def bad(what):
        raise ConfigError("%s: key '%s': expected %s, got %r" % (source, key, what, value))
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        bad("true or false")
    if isinstance(default, int):
        if key == "train.micro_batch" and value == "auto":
            return -1
        if isinstance(value, bool):
            bad("an integer")
        if isinstance(value, int):
            return value
        try:
            return int(str(value), 10)
        except ValueError:
            bad("an integer")
    if isinstance(default, float):
        if isinstance(value, bool):
            bad("a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            bad("a number")
    if key == "model.lora.targets":
        if not isinstance(value, list):
            bad("a list of layer names")
        return [str(v) for v in value]
    if isinstance(default, list):
        if not isinstance(value, list):
            bad("a list of integers")
        return [coerce(v, 0, key, source) for v in value]
    return "" if value is None else str(value)  # strings


def apply_tree(cfg, node, prefix, source):
    if not isinstance(node, dict):
        raise ConfigError("%s: expected a mapping%s, got %r" % (source, " at '%s'" % prefix if prefix else "", node))
    for k, v in node.items():
        key = "%s.%s" % (prefix, k) if prefix else str(k)
        section = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            section = section.get(p) if isinstance(section, dict) else None
        if not isinstance(section, dict) or parts[-1] not in section:
            raise ConfigError("%s: key '%s': unknown key" % (source, key))
        if isinstance(section[parts[-1]], dict):
            apply_tree(cfg, v, key, source)
        else:
            section[parts[-1]] = coerce(v, section[parts[-1]], key, source)


def load_config(path, sets):
    """defaults < YAML file < --set key=value (value parsed as YAML), as trainer::load_config."""
    cfg = copy.deepcopy(DEFAULTS)
    if path:
        try:
            with open(path) as f:
                node = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError("%s: cannot read the config file (%s)" % (path, e.strerror))
        if node is not None:
            apply_tree(cfg, node, "", path)
    for s in sets:
        key, eq, value = s.partition("=")
        if not eq or not key:
            raise ConfigError("--set %s: expected key=value" % s)
        node = {}
        leaf = node
        parts = key.split(".")
        for p in parts[:-1]:
            leaf = leaf.setdefault(p, {})
        leaf[parts[-1]] = yaml.safe_load(value) if value.strip() else None
        apply_tree(cfg, node, "", "--set " + s)
    return cfg


def is_gpt(cfg):
    return cfg["model"]["name"] in GPTS


def is_llama(cfg):
    return cfg["model"]["name"] in LLAMAS


def is_language_model(cfg):
    return is_gpt(cfg) or is_llama(cfg)


def registered_arch(table, cfg):
    """The registered model's options as models/registry.cpp builds them: model.context replaces the
    registered context when non-zero; the vocabulary is --vocab-size when given, else model.vocab_size when
    non-zero."""
    a = dict(table[cfg["model"]["name"]])
    if cfg["model"]["context"] > 0:
        a["context"] = cfg["model"]["context"]
    if VOCAB_SIZE > 0:
        a["vocab_size"] = VOCAB_SIZE
    elif cfg["model"]["vocab_size"] > 0:
        a["vocab_size"] = cfg["model"]["vocab_size"]
    a["dropout"] = cfg["model"]["dropout"]
    return a


def lm_arch(cfg):
    """A language model's options: a GPT's (gpt_arch), or a registered Llama-family shape's."""
    return gpt_arch(cfg) if is_gpt(cfg) else registered_arch(LLAMAS, cfg)


def gpt_arch(cfg):
    """The GPT's options (registered_arch), with model.vocab_multiple and model.fused_bias."""
    a = registered_arch(GPTS, cfg)
    a["vocab_multiple"] = cfg["model"]["vocab_multiple"]
    a["fused_bias"] = cfg["model"]["fused_bias"]
    return a


def sample_shape(cfg):
    """(C, H, W) for images, (T) for a language model: what models::ModelImpl::forward_flops takes."""
    if is_language_model(cfg):
        return [lm_arch(cfg)["context"]]
    return list(cfg["data"]["shape"])


def check_mirrored(cfg):
    kind = cfg["data"]["kind"]
    if kind not in ("synthetic", "tokens"):
        raise ConfigError("config: key 'data.kind': the Python reference runs on synthetic images or token "
                          "streams only; set data.kind: synthetic or tokens (got '%s')" % kind)
    if kind == "tokens" and not is_language_model(cfg):
        raise ConfigError("config: key 'data.kind': %s trains on images (synthetic), got data.kind 'tokens'"
                          % cfg["model"]["name"])
    if is_language_model(cfg) and cfg["model"]["context"] <= 0:
        raise ConfigError("config: key 'model.context': a language model needs the tokens per sample")
    if cfg["memory"]["activation_checkpointing"] != "none":
        raise ConfigError("config: key 'memory.activation_checkpointing': not mirrored by the Python reference; "
                          "benchmark with none")
    if kind == "synthetic" and not is_language_model(cfg) and len(cfg["data"]["shape"]) != 3:
        raise ConfigError("config: key 'data.shape': expected (C, H, W), got %r" % cfg["data"]["shape"])
    check_recipe_mirrored(cfg)


def check_recipe_mirrored(cfg):
    """The image recipes' keys (docs/RECIPES.md) that this reference does not run: refused, so that a
    comparison is never of two different jobs."""
    t, d, o = cfg["train"], cfg["data"], cfg["optim"]
    unmirrored = [("optim.name", o["name"] not in ("sgd", "adamw"), "lamb"),
                  ("optim.state_dtype", o["state_dtype"] != "float32", "state in %s" % o["state_dtype"]),
                  ("memory.state", cfg["memory"]["state"] != "fixed", "a state dtype chosen by the memory plan"),
                  ("model.param_dtype", cfg["model"]["param_dtype"] != "float32", "bfloat16 weights"),
                  ("train.loss", t["loss"] != "cross_entropy", "bce"),
                  ("train.mixup_alpha", t["mixup_alpha"] > 0, "Mixup"),
                  ("train.cutmix_alpha", t["cutmix_alpha"] > 0, "CutMix"),
                  ("train.ema_decay", t["ema_decay"] > 0, "the EMA of the weights"),
                  ("data.auto_augment", d["auto_augment"] != "none", d["auto_augment"]),
                  ("data.random_erasing", d["random_erasing"] > 0, "random erasing")]
    for key, on, what in unmirrored:
        if on:
            raise ConfigError("config: key '%s': %s is not mirrored by the Python reference; benchmark without it"
                              % (key, what))


# ---- synthetic tokens: data/files/token_h5.h's SyntheticTokens and TokenLoader, repeated ----------------------

MASK64 = (1 << 64) - 1
GOLDEN = 0x9e3779b97f4a7c15


def mix64(z):
    """splitmix64's output function (data/pixels/rng.h), on a Python int."""
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & MASK64
    return z ^ (z >> 31)


def synthetic_token_block(seed, vocab, starts, n):
    """Tokens [s, s + n) of the trainer's synthetic stream for each s in `starts`, as int64 (len(starts), n):
    token k = floor(hi32(mix64(state + (k + 1) * golden)) * vocab / 2^32), state = mix64(hash_key(seed,
    "synto")). numpy's uint64 arithmetic wraps modulo 2^64, as C++'s does."""
    import numpy as np
    state = mix64(mix64((mix64(seed) + GOLDEN * (0x73796e746f + 1)) & MASK64))  # mix64(hash_key(seed, tag))
    u = np.uint64
    k = np.asarray(starts, dtype=u)[:, None] + np.arange(1, n + 1, dtype=u)[None, :]  # (B, n): k + 1
    z = u(state) + u(GOLDEN) * k
    z = (z ^ (z >> u(30))) * u(0xbf58476d1ce4e5b9)
    z = (z ^ (z >> u(27))) * u(0x94d049bb133111eb)
    z = z ^ (z >> u(31))
    return ((z >> u(32)) * u(vocab) >> u(32)).astype(np.int64)


def token_windows(seed, epoch, slots, T, N):
    """TokenLoader::epoch_windows: each window's first token, in epoch `epoch`'s order."""
    state = mix64((mix64(seed) + GOLDEN * (epoch + 1)) & MASK64) ^ 0x746f6b656e73

    def below(n):  # modulo rejection, as tokens.cpp's Rng
        nonlocal state
        limit = MASK64 - MASK64 % n
        while True:
            state = (state + GOLDEN) & MASK64
            r = mix64(state)
            if r < limit:
                return r % n

    offset = below(N - 1 - slots * T + 1)
    order = list(range(slots))
    for i in range(slots - 1, 0, -1):  # Fisher-Yates
        j = below(i + 1)
        order[i], order[j] = order[j], order[i]
    return [offset + s * T for s in order]


def synthetic_token_batches(cfg, vocab, count, torch):
    """The trainer's first `count` global batches of data.kind synthetic for a GPT (trainer/run/from_config.cpp
    synthetic_tokens: data.synthetic_size windows of T per epoch, (size + 1) * T + 1 tokens), as (x, y)."""
    T, G, S = cfg["model"]["context"], cfg["train"]["global_batch"], cfg["data"]["synthetic_size"]
    N = (S + 1) * T + 1
    batches, epoch, position, order = [], 0, 0, None
    while len(batches) < count:
        if position + G > S:
            epoch, position, order = epoch + 1, 0, None
        if order is None:
            order = token_windows(cfg["seed"], epoch, S, T, N)
        w = torch.from_numpy(synthetic_token_block(cfg["seed"], vocab, order[position:position + G], T + 1))
        batches.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))  # (G, T) each
        position += G
    return batches


# ---- the machine ----------------------------------------------------------------------------------

def cgroup_cpu_quota():
    """CPUs allowed by this process's cgroup (v2 cpu.max, smallest over the ancestors; v1 cfs quota);
    0 = no quota. Mirrors trainer/memory/resources.cpp's read_cgroup_cpu."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0.0
    best = 0.0
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and ctrls == "":  # v2
            p = path
            while True:
                try:
                    with open(os.path.join("/sys/fs/cgroup", p.lstrip("/"), "cpu.max")) as f:
                        quota, period = f.read().split()
                    if quota != "max":
                        q = float(quota) / float(period)
                        best = q if best == 0 else min(best, q)
                except (OSError, ValueError):
                    pass
                if p in ("/", ""):
                    break
                p = os.path.dirname(p)
        elif "cpu" in ctrls.split(","):  # v1
            base = os.path.join("/sys/fs/cgroup", ctrls, path.lstrip("/"))
            try:
                with open(os.path.join(base, "cpu.cfs_quota_us")) as f:
                    quota = int(f.read())
                with open(os.path.join(base, "cpu.cfs_period_us")) as f:
                    period = int(f.read())
                if quota > 0 and period > 0:
                    best = quota / period if best == 0 else min(best, quota / period)
            except (OSError, ValueError):
                pass
    return best


def usable_cpus():
    n = len(os.sched_getaffinity(0)) or os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota > 0:
        n = min(n, math.ceil(quota - 1e-9))
    return max(1, n)


def known_peak_tflops(name, precision):
    """Dense tensor-core TFLOP/s; the same table as tools/bench/bench_train.cpp's known_peak_tflops."""
    if precision not in ("bf16", "fp16"):
        return 0.0
    if "H200" in name and "NVL" not in name:
        return 989.4
    if "H100" in name and ("HBM3" in name or "SXM" in name):
        return 989.4
    if "H100" in name and "PCIe" in name:
        return 756.0
    if "A100" in name:
        return 312.0
    return 0.0


def percentile(values, q):
    """numpy.percentile's default (linear interpolation), as tools/percentile.h's percentile."""
    v = sorted(values)
    rank = q / 100.0 * (len(v) - 1)
    lo = int(math.floor(rank))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (rank - lo) * (v[hi] - v[lo])


# ---- the model ------------------------------------------------------------------------------------

def build_gpt(a, torch, nn, F, device=None):
    """models/gpt.cpp in plain PyTorch, module for module (the same names, so the same state dict).
    device="meta" builds it without memory (for --describe)."""
    fused = ATTENTION == "auto" and hasattr(F, "scaled_dot_product_attention")

    linear = {"fused_bias": a.get("fused_bias", True)}  # forward_flops turns it on: its hooks see nn.Linear calls

    def lin(layer, x):
        """nn.Linear (the bias inside the matmul), or with model.fused_bias false what LibTorch's nn::Linear
        runs for (B, T, C): the matmul, then the bias added over the whole output."""
        return layer(x) if linear["fused_bias"] else torch.matmul(x, layer.weight.t()) + layer.bias

    class SelfAttention(nn.Module):
        """models/attention.cpp SelfAttentionImpl: the fused kernel where torch has it (the trainer's
        automatic backend), else the plain path (what LibTorch 1.13 runs)."""

        def __init__(self):
            super().__init__()
            self.n_head, self.p = a["n_head"], a["dropout"]
            self.c_attn = nn.Linear(a["n_embd"], 3 * a["n_embd"], device=device)
            self.c_proj = nn.Linear(a["n_embd"], a["n_embd"], device=device)
            self.resid_dropout = nn.Dropout(a["dropout"])
            self.macs = 0  # q k^T and att v of the last forward, per sequence

        def forward(self, x):
            B, T, C = x.shape
            nh, hs = self.n_head, C // self.n_head
            q, k, v = lin(self.c_attn, x).split(C, dim=2)       # 3 x (B, T, C)
            q = q.view(B, T, nh, hs).transpose(1, 2)            # (B, nh, T, hs)
            k = k.view(B, T, nh, hs).transpose(1, 2)            # (B, nh, T, hs)
            v = v.view(B, T, nh, hs).transpose(1, 2)            # (B, nh, T, hs)
            if fused:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                                   is_causal=True)  # (B, nh, T, hs)
            else:
                att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
                future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
                att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
                if self.training and self.p > 0:
                    att = F.dropout(att, self.p, True)
                y = torch.matmul(att, v)                        # (B, nh, T, hs)
            self.macs = 2 * T * T * C
            y = y.transpose(1, 2).contiguous().view(B, T, C)    # (B, T, C)
            return self.resid_dropout(lin(self.c_proj, y))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(a["n_embd"], 4 * a["n_embd"], device=device)
            self.c_proj = nn.Linear(4 * a["n_embd"], a["n_embd"], device=device)
            self.dropout = nn.Dropout(a["dropout"])

        def forward(self, x):
            return self.dropout(lin(self.c_proj, F.gelu(lin(self.c_fc, x), approximate="tanh")))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(a["n_embd"], device=device)
            self.attn = SelfAttention()
            self.ln_2 = nn.LayerNorm(a["n_embd"], device=device)
            self.mlp = MLP()

        def forward(self, x):
            h = x + self.attn(self.ln_1(x))
            return h + self.mlp(self.ln_2(h))

    V = a["vocab_size"]
    m = a.get("vocab_multiple", 1)
    padded = (V + m - 1) // m * m  # models/gpt.h GPTImpl::padded_vocab

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(padded, a["n_embd"], device=device),
                wpe=nn.Embedding(a["context"], a["n_embd"], device=device),
                drop=nn.Dropout(a["dropout"]), h=nn.ModuleList([Block() for _ in range(a["n_layer"])]),
                ln_f=nn.LayerNorm(a["n_embd"], device=device)))
            self.head_macs = 0  # the tied output projection of the last forward, per sequence
            self.linear = linear
            # GPT-2 init (models/gpt.cpp, gpt2_init_block): N(0, 0.02), biases 0, the two c_proj per block
            # N(0, 0.02 / sqrt(2 n_layer)); LayerNorms keep weight 1, bias 0.
            with torch.no_grad():
                nn.init.normal_(self.transformer.wte.weight[:V], 0.0, 0.02)
                nn.init.zeros_(self.transformer.wte.weight[V:])  # padding rows: never looked up, logits dropped
                nn.init.normal_(self.transformer.wpe.weight, 0.0, 0.02)
                for b in self.transformer.h:
                    for lin in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj):
                        nn.init.normal_(lin.weight, 0.0, 0.02)
                        nn.init.zeros_(lin.bias)
                    for lin in (b.attn.c_proj, b.mlp.c_proj):
                        nn.init.normal_(lin.weight, 0.0, 0.02 / math.sqrt(2.0 * a["n_layer"]))

        def forward(self, tokens):
            T = tokens.shape[1]
            pos = torch.arange(T, device=tokens.device)                                      # (T)
            x = self.transformer.drop(self.transformer.wte(tokens) + self.transformer.wpe(pos))  # (B, T, C)
            for b in self.transformer.h:
                x = b(x)
            x = self.transformer.ln_f(x)
            self.head_macs = T * a["n_embd"] * a["vocab_size"]
            # (B, T, padded): tied to the token embedding. The padding columns stay on: the loss either
            # takes them whole, masked (padded_cross_entropy), or slices them off (--padded-loss slice).
            return F.linear(x, self.transformer.wte.weight)

        def extra_macs(self):
            """Multiply-adds the Linear hooks do not see: attention matmuls and the tied projection."""
            return self.head_macs + sum(b.attn.macs for b in self.transformer.h)

    model = GPT()
    model.columns = V  # the real columns of the (padded) output: models::ModelImpl::Padded::columns
    return model


def padded_cross_entropy(logits, y, columns, label_smoothing, how, torch, F):
    """The step's loss: cross-entropy in float32 summed over the rows of `logits` (N, W), of which the first
    `columns` are real (GPT's padded vocabulary: W > columns), as trainer/numerics/loss.h's
    summed_cross_entropy: the padding columns take no part in it.

    how "full" (the default, nanoGPT's cost): the float32 copy of all W columns, as nanoGPT's
    F.cross_entropy over its 50304 columns makes under autocast; its padding columns set to -inf in place,
    outside autograd (a strided fill of W - columns columns), so they add exp(-inf) = 0 to each row's sum
    and get a zero gradient: the loss and gradients of the real columns alone, with no slice whose
    backward zero-fills and copies the whole (N, W) gradient. With label smoothing (which averages over
    every column) the padding columns cannot be masked away: the slice then.
    how "slice": the real columns cut off before the float32 copy (the reference before; its backward pays
    the zero-fill and the copy)."""
    width = logits.shape[-1]
    if columns >= width:
        return F.cross_entropy(logits.float(), y, reduction="sum", label_smoothing=label_smoothing)
    if how == "slice" or label_smoothing > 0:
        return F.cross_entropy(logits[:, :columns].float(), y, reduction="sum", label_smoothing=label_smoothing)
    full = logits.float()
    with torch.no_grad():
        full.narrow(1, columns, width - columns).fill_(float("-inf"))
    return F.cross_entropy(full, y, reduction="sum")


def build_llama(a, torch, nn, device=None):
    """A registered Llama-family shape as transformers' own model (LlamaForCausalLM, Qwen2ForCausalLM), the
    PyTorch eager model a user of transformers trains: random weights (its own init), attention through
    F.scaled_dot_product_attention (sdpa, the trainer's automatic backend) or written out (--attention plain:
    eager). Called with the token ids it returns the logits (B, T, V), like build_gpt's model.
    device="meta" builds it without memory (for --describe)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("config: key 'model.name': %s is mirrored by transformers' model, and this Python (%s) "
                          "has no transformers; run the reference with an interpreter that has it"
                          % (a["name"], sys.executable))
    args = {k: v for k, v in a.items() if k not in ("arch", "name", "context", "dropout", "rope_theta",
                                                    "rope_scaling")}
    # transformers 5.x keeps rope_theta and the scaling in rope_parameters (4.x: rope_theta, rope_scaling).
    rope = dict(a.get("rope_scaling") or {"rope_type": "default"}, rope_theta=a["rope_theta"])
    config_cls = getattr(transformers, a["arch"].replace("ForCausalLM", "Config"))
    # max_position_embeddings: the registered length (the rotary frequencies do not depend on it; a shorter
    # model.context only trains shorter sequences).
    config = config_cls(**args, max_position_embeddings=LLAMAS[a["name"]]["context"], rope_parameters=rope,
                        attention_dropout=a["dropout"], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa" if ATTENTION == "auto" else "eager"
    with torch.device(device or "cpu"):
        hf = getattr(transformers, a["arch"])(config)
    q = a["num_attention_heads"] * a.get("head_dim", a["hidden_size"] // a["num_attention_heads"])

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf
            self.T = 0

        def forward(self, tokens):
            self.T = tokens.shape[1]
            return self.hf(input_ids=tokens, use_cache=False).logits  # (B, T, V)

        def meta_macs(self, T):
            """Multiply-adds of one sequence without running it (transformers' forward cannot run on the
            meta device: its mask reads values): every Linear applies once per token here, q k^T and
            att v added. --describe on the CPU (llama_tiny) checks it against the hooks' count."""
            self.T = T
            return T * sum(m.in_features * m.out_features for m in self.modules()
                           if isinstance(m, nn.Linear)) + self.extra_macs()

        def extra_macs(self):
            """The attention matmuls (q k^T and att v over the query heads), which no Linear hook sees."""
            return a["num_hidden_layers"] * 2 * self.T * self.T * q

        def state_names(self):
            """transformers' parameter names (the trainer's), the tied output projection once."""
            return {k: list(p.shape) for k, p in self.hf.named_parameters()}

    model = CausalLM()
    model.columns = a["vocab_size"]
    return model


def with_lora(model, cfg):
    """model.lora: peft's LoRA injected into the model's Linear layers (LoraConfig with the trainer's
    settings; peft freezes every other parameter), the model a peft user trains."""
    lora = cfg["model"]["lora"]
    if lora["rank"] == 0:
        return model
    if cfg["model"]["lora_init_from"]:
        raise ConfigError("config: key 'model.lora_init_from': not mirrored by the Python reference")
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ConfigError("config: key 'model.lora.rank': LoRA is mirrored by peft, and this Python (%s) has no "
                          "peft; run the reference with an interpreter that has it" % sys.executable)
    targets = lora["targets"] or (["q_proj", "v_proj"] if is_llama(cfg) else ["c_attn"])
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=targets, use_rslora=lora["use_rslora"])
    inject_adapter_in_model(config, model)
    return model


def build_model(cfg, torch, nn, F):
    name = cfg["model"]["name"]
    if name in GPTS:
        return build_gpt(gpt_arch(cfg), torch, nn, F)
    if name in LLAMAS:
        return build_llama(dict(lm_arch(cfg), name=name), torch, nn)
    classes = cfg["model"]["num_classes"]
    channels = cfg["data"]["shape"][0]
    zero_init = cfg["model"]["zero_init_residual"]

    class CifarBlock(nn.Module):
        """models/resnet.cpp's BasicBlock with an option A shortcut: subsample x[:, :, ::s, ::s] and append
        zero channels."""

        def __init__(self, inp, planes, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(inp, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.stride, self.extra = stride, planes - inp

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            sc = x
            if self.stride != 1 or self.extra != 0:
                sc = x[:, :, ::self.stride, ::self.stride] if self.stride != 1 else x
                sc = F.pad(sc, (0, 0, 0, 0, 0, self.extra))
            return F.relu(out + sc)

    class CifarResNet(nn.Module):
        """He et al. 2016 section 4.2: 3x3 stem, three stages of n blocks at 16/32/64 channels."""

        def __init__(self, n):
            super().__init__()
            self.conv1 = nn.Conv2d(channels, 16, 3, 1, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(16)
            inp = 16
            for s, width in enumerate((16, 32, 64)):
                blocks = []
                for b in range(n):
                    blocks.append(CifarBlock(inp, width, 2 if s > 0 and b == 0 else 1))
                    inp = width
                setattr(self, "layer%d" % (s + 1), nn.ModuleList(blocks))
            self.fc = nn.Linear(64, classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)
            if zero_init:
                for m in self.modules():
                    if isinstance(m, CifarBlock):
                        nn.init.zeros_(m.bn2.weight)

        def forward(self, x):
            h = F.relu(self.bn1(self.conv1(x)))
            for layer in (self.layer1, self.layer2, self.layer3):
                for block in layer:
                    h = block(h)
            h = F.adaptive_avg_pool2d(h, 1).flatten(1)
            return self.fc(h)

    class Basic(nn.Module):
        expansion = 1

        def __init__(self, inp, planes, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(inp, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = projection(inp, planes, stride)

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return F.relu(out + (self.downsample(x) if self.downsample is not None else x))

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, inp, planes, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(inp, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)  # v1.5: stride on the 3x3
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(planes * 4)
            self.downsample = projection(inp, planes * 4, stride)

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            out = F.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return F.relu(out + (self.downsample(x) if self.downsample is not None else x))

    def projection(inp, out, stride):
        if stride == 1 and inp == out:
            return None
        return nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    class ImageNetResNet(nn.Module):
        """torchvision's ResNet (v1.5), for hosts without torchvision: the same structure, names and init."""

        def __init__(self, block, layers):
            super().__init__()
            self.conv1 = nn.Conv2d(channels, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            inp = 64
            for s, (n, width) in enumerate(zip(layers, (64, 128, 256, 512))):
                blocks = []
                for b in range(n):
                    blocks.append(block(inp, width, 2 if s > 0 and b == 0 else 1))
                    inp = width * block.expansion
                setattr(self, "layer%d" % (s + 1), nn.Sequential(*blocks))
            self.fc = nn.Linear(inp, classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)
            if zero_init:
                for m in self.modules():
                    if isinstance(m, Basic):
                        nn.init.zeros_(m.bn2.weight)
                    elif isinstance(m, Bottleneck):
                        nn.init.zeros_(m.bn3.weight)

        def forward(self, x):
            h = self.maxpool(F.relu(self.bn1(self.conv1(x))))
            h = self.layer4(self.layer3(self.layer2(self.layer1(h))))
            return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))

    cifar = {"resnet20": 3, "resnet32": 5, "resnet56": 9}
    imagenet = {"resnet18": (Basic, [2, 2, 2, 2]), "resnet34": (Basic, [3, 4, 6, 3]),
                "resnet50": (Bottleneck, [3, 4, 6, 3]), "resnet101": (Bottleneck, [3, 4, 23, 3]),
                "resnet152": (Bottleneck, [3, 8, 36, 3])}
    if name in cifar:
        return CifarResNet(cifar[name])
    if name in imagenet:
        try:
            if MODELS == "builtin":
                raise ImportError("--models builtin")
            import torchvision
        except ImportError:
            return ImageNetResNet(*imagenet[name])
        model = getattr(torchvision.models, name)(weights=None, num_classes=classes, zero_init_residual=zero_init)
        if channels != 3:
            model.conv1 = nn.Conv2d(channels, 64, 7, 2, 3, bias=False)
            nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        return model
    raise ConfigError("config: key 'model.name': the Python reference has no model '%s'" % name)


def models_source():
    """Where the ImageNet ResNets come from: torchvision when importable (and not --models builtin)."""
    if MODELS == "builtin":
        return "builtin"
    try:
        import torchvision
        return "torchvision " + torchvision.__version__
    except ImportError:
        return "builtin (no torchvision)"


def forward_flops(model, shape, torch, nn):
    """Conv2d and Linear FLOPs (2 x multiply-adds) for one sample, counted by forward hooks, plus (GPT) the
    attention matmuls and the tied output projection: the convention of models::ModelImpl::forward_flops."""
    if next(model.parameters()).is_meta and hasattr(model, "meta_macs"):
        return 2.0 * model.meta_macs(shape[0])
    macs = [0]

    def conv_hook(m, inputs, out):
        kh, kw = m.kernel_size
        macs[0] += (out.numel() // out.shape[0]) * (m.in_channels // m.groups) * kh * kw

    def linear_hook(m, inputs, out):
        macs[0] += (out.numel() // out.shape[0]) * m.in_features

    handles = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
    was_training = model.training
    model.eval()
    linear = getattr(model, "linear", {})
    fused = linear.get("fused_bias")
    linear["fused_bias"] = True  # the same FLOPs either way; the hooks see nn.Linear calls only
    with torch.no_grad():
        model(torch.zeros(1, *shape, dtype=torch.long if len(shape) == 1 else torch.float,
                          device=next(model.parameters()).device))
    if fused is not None:
        linear["fused_bias"] = fused
    model.train(was_training)
    for h in handles:
        h.remove()
    if hasattr(model, "extra_macs"):
        macs[0] += model.extra_macs()
    return 2.0 * macs[0]


def optimizer_implementation(name, device, torch):
    """torch.optim's keyword arguments for optim.implementation (trainer/numerics/optim.h's choice of kernels):
    auto is the trainer's auto, the fused kernels on CUDA where torch has them for both optimizers
    (2.4+, as the trainer's compat::kHasFusedOptimizers), torch.optim's default (foreach) before that,
    and a loop over the tensors on the CPU."""
    if name == "auto":
        if device.type != "cuda":
            return {"foreach": False}
        return {"fused": True} if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 4) else {}
    return {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[name]


def learning_rate(cfg, step, total_steps, warmup_steps):
    """trainer/numerics/optim.cpp's learning_rate for the 0-based optimizer step `step`."""
    peak, s = cfg["optim"]["lr"], cfg["schedule"]
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if s["name"] == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return s["min_lr"] + (peak - s["min_lr"]) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if s["name"] == "step":
        return peak * s["gamma"] ** sum(1 for m in s["milestones"] if step >= m)
    return peak


# ---- the measurement ------------------------------------------------------------------------------

def run(cfg, args, torch):
    nn, F = torch.nn, torch.nn.functional
    check_mirrored(cfg)
    threads = cfg["train"]["threads"] or usable_cpus()
    try:
        torch.set_num_interop_threads(threads)  # only before any parallel work, as the trainer
    except RuntimeError:
        pass
    torch.set_num_threads(threads)
    torch.manual_seed(cfg["seed"])
    dev_spec = cfg["train"]["device"]
    if dev_spec == "auto":
        dev_spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev_spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    cuda = device.type == "cuda"
    if cfg["train"]["deterministic"]:
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not cfg["train"]["deterministic"]

    shape = sample_shape(cfg)
    tokens = is_language_model(cfg)
    G = cfg["train"]["global_batch"]
    mb = cfg["train"]["micro_batch"]
    mb = G if mb <= 0 else min(mb, G)  # `auto` (-1): the whole batch; compare.py passes the trainer's choice
    channels_last = cfg["model"]["channels_last"]
    amp = cfg["amp"]
    precision = amp["dtype"] if amp["enabled"] else "fp32"
    amp_dtype = torch.float16 if amp["dtype"] == "fp16" else torch.bfloat16
    if amp["enabled"] and amp["dtype"] == "fp16" and not cuda:
        raise ConfigError("config: key 'amp.dtype': fp16 autocast needs a CUDA device (use bf16 on the CPU)")
    use_scaler = amp["enabled"] and amp["dtype"] == "fp16" and amp["scaler"] != "false"

    model = build_model(cfg, torch, nn, F)
    fwd_flops = forward_flops(model, shape, torch, nn)  # of the base: the trainer counts no adapter either
    model = with_lora(model, cfg)
    columns = getattr(model, "columns", 1 << 62)  # a GPT's real vocabulary; every column of an image model's
    model.to(device)
    if channels_last and not tokens:
        model.to(memory_format=torch.channels_last)
    if args.compile:
        if not hasattr(torch, "compile"):
            raise ConfigError("command line: --compile: torch %s has no torch.compile (2.0+)" % torch.__version__)
        model = torch.compile(model)  # compiled at its first call: the first step's time holds the compile

    o = cfg["optim"]
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:  # LoRA: the adapters alone
            (decay if o["decay_norm_and_bias"] or p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    impl = optimizer_implementation(o["implementation"], torch.device(device), torch)
    try:
        if o["name"] == "sgd":
            opt = torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"],
                                  nesterov=o["nesterov"] and o["momentum"] > 0, **impl)
        else:
            opt = torch.optim.AdamW(groups, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"], **impl)
    except (TypeError, RuntimeError) as e:  # a torch without the fused kernel for this optimizer or device
        raise ConfigError("config: key 'optim.implementation': %s is not available in torch %s for %s: %s"
                          % (o["implementation"], torch.__version__, o["name"], e))
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):  # 2.3+
        scaler = torch.amp.GradScaler("cuda", init_scale=amp["init_scale"], growth_factor=amp["growth_factor"],
                                      backoff_factor=amp["backoff_factor"], growth_interval=amp["growth_interval"],
                                      enabled=use_scaler)
    else:
        scaler = torch.cuda.amp.GradScaler(init_scale=amp["init_scale"], growth_factor=amp["growth_factor"],
                                           backoff_factor=amp["backoff_factor"],
                                           growth_interval=amp["growth_interval"], enabled=use_scaler)

    # The data: a pool of pre-generated batches: uint8 noise normalized as the trainer's synthetic dataset,
    # or windows of T + 1 random token ids (inputs: the first T, targets: the last T).
    gen = torch.Generator().manual_seed(cfg["seed"])
    std = math.sqrt((256.0 ** 2 - 1) / 12.0) / 255.0
    vocab = lm_arch(cfg)["vocab_size"] if tokens else 0
    pool = []
    synthetic = synthetic_token_batches(cfg, vocab, POOL_BATCHES, torch) if tokens and cfg["data"]["kind"] == "synthetic" else None
    for i in range(POOL_BATCHES):
        if synthetic:
            x, y = synthetic[i]
        elif tokens:
            w = torch.randint(0, vocab, (G, shape[0] + 1), generator=gen)
            x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (G, T) each
        else:
            img = torch.randint(0, 256, (G, *shape), dtype=torch.uint8, generator=gen)
            x = (img.float() / 255.0 - 0.5) / std if cfg["data"]["normalize"] else img.float() / 255.0
            y = torch.randint(0, cfg["model"]["num_classes"], (G,), generator=gen)
        if cuda:
            x, y = x.pin_memory(), y.pin_memory()
        pool.append((x, y))
    targets = G * shape[0] if tokens else G  # the loss is the mean over the step's targets

    total = args.warmup + args.steps
    warmup_sched = cfg["schedule"]["warmup_steps"]  # warmup_epochs has no meaning for a synthetic pool
    records, t_end = [], {}
    model.train()
    prof = None
    if args.profile:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        prof = torch.profiler.profile(activities=acts)
    for step in range(total):
        # --profile: prepared a step ahead (as the trainer's StepProfiler), then the timed steps, each in
        # its "ProfilerStep#<1-based step>" scope.
        profiled = prof is not None and step >= args.warmup
        if prof is not None and step == max(0, args.warmup - 1):
            prof.prepare_trace()
        if profiled and step == args.warmup:
            prof.start_trace()
        scope = torch.autograd.profiler.record_function("ProfilerStep#%d" % (step + 1)) if profiled else None
        if scope is not None:
            scope.__enter__()
        t0 = time.perf_counter()
        images, labels = pool[step % POOL_BATCHES]
        t1 = time.perf_counter()
        lr = learning_rate(cfg, step, total, warmup_sched)
        for g in opt.param_groups:
            g["lr"] = lr
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for start in range(0, G, mb):
            x = images[start:start + mb].to(device, non_blocking=True)
            if channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            y = labels[start:start + mb].to(device, non_blocking=True).reshape(-1)  # (B) or (B*T)
            with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp["enabled"]):
                logits = model(x)
            loss = padded_cross_entropy(logits.reshape(y.shape[0], -1), y, columns,
                                        cfg["train"]["label_smoothing"], args.padded_loss, torch, F) / targets
            scaler.scale(loss).backward()
            loss_sum += loss.detach()
        if o["grad_clip"] > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        scaler.step(opt)
        scaler.update()
        loss_value = loss_sum.item()  # the one host sync per step
        t2 = time.perf_counter()
        t_end[step + 1] = t2
        records.append({"step": step + 1, "step_time_s": t2 - t1, "data_wait_s": t1 - t0, "loss": loss_value,
                        "mem_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None})
        if scope is not None:
            scope.__exit__(None, None, None)
    if prof is not None:
        prof.stop_trace()
        prof.export_chrome_trace(args.profile)

    return summarize(cfg, args, torch, records, t_end, dict(
        G=G, mb=mb, shape=shape, tokens=tokens, vocab=vocab, precision=precision, channels_last=channels_last,
        threads=threads, fwd_flops=fwd_flops, device=device, cuda=cuda, prof=prof, total=total,
        padded=padded_loss_of(columns, shape, tokens, vocab, cfg, args)))


def padded_loss_of(columns, shape, tokens, vocab, cfg, args):
    """How the loss took a padded vocabulary's columns (None for an unpadded output)."""
    if not tokens:
        return None
    m = cfg["model"]["vocab_multiple"]
    padded = (vocab + m - 1) // m * m
    if padded == columns:
        return None
    how = "slice" if args.padded_loss == "slice" or cfg["train"]["label_smoothing"] > 0 else "full"
    return {"columns": columns, "width": padded, "how": how}


def summarize(cfg, args, torch, records, t_end, job):
    """The result JSON from the step records: the schema of `trainer bench` (tools/bench/bench_stats.cpp's
    summarize_steps and bench_train.cpp's figures), every headline figure by wall time over the timed steps."""
    G, shape, tokens, precision, fwd_flops = job["G"], job["shape"], job["tokens"], job["precision"], job["fwd_flops"]
    device, cuda, prof, total = job["device"], job["cuda"], job["prof"], job["total"]
    mb, vocab, channels_last, threads = job["mb"], job["vocab"], job["channels_last"], job["threads"]
    timed = records[args.warmup:]
    step_time = [r["step_time_s"] for r in timed]
    tot = [r["step_time_s"] + r["data_wait_s"] for r in timed]
    wait_sum = sum(r["data_wait_s"] for r in timed)
    res = {
        "schema": SCHEMA, "implementation": "pytorch", "mode": "train",
        "model": cfg["model"]["name"], "sample_shape": list(shape), "global_batch": G,
        "config_file": args.config, "overrides": args.set, "command_line": " ".join([sys.executable] + sys.argv),
        "timed_steps": len(timed), "warmup_steps": args.warmup,
        "step_time_s_p50": percentile(step_time, 50), "step_time_s_p90": percentile(step_time, 90),
        "step_time_s_mean": statistics.fmean(step_time), "step_time_s_min": min(step_time),
        "step_time_s_max": max(step_time),
        "step_total_s_p50": percentile(tot, 50), "step_total_s_p90": percentile(tot, 90),
        "data_wait_s_sum": wait_sum, "data_wait_share": wait_sum / sum(tot),
        "samples_per_s_median": percentile([G / t for t in tot], 50),
    }
    if args.warmup > 0:
        res["wall_s"] = t_end[total] - t_end[args.warmup]
        res["wall_source"] = "perf_counter after each step"
    else:
        res["wall_s"] = sum(tot)
        res["wall_source"] = "sum of step_time + data_wait"
    res["samples_per_s_aggregate"] = len(timed) * G / res["wall_s"]
    res["figures_basis"] = ("wall time over the timed steps" if args.warmup > 0
                            else "sum of step_time + data_wait (no warmup step starts the clock)")
    peaks = [r["mem_peak_bytes"] for r in timed if r["mem_peak_bytes"] is not None]
    res.update({
        "mem_peak_bytes": max(peaks) if peaks else None, "micro_batch": mb, "oom_retries": 0, "skipped_updates": 0,
        "loss_first": timed[0]["loss"], "loss_last": timed[-1]["loss"],
        "losses": [r["loss"] for r in records],  # every step's, the warmup's first
        "precision": precision, "channels_last": channels_last, "threads": threads, "loader_workers": 0,
        "data": "pool of %d pre-generated batches, cycled" % POOL_BATCHES,
        "flops_per_sample_forward": fwd_flops, "flops_per_sample_train": 3 * fwd_flops,
    })
    if tokens:
        res.update({"context": shape[0], "vocab_size": vocab,
                    "tokens_per_s_median": res["samples_per_s_median"] * shape[0],
                    "tokens_per_s_aggregate": res["samples_per_s_aggregate"] * shape[0]})
    # MFU and the achieved TFLOP/s by wall time (samples_per_s_aggregate), as `trainer bench`; the median
    # step's beside them, named so.
    achieved = 3 * fwd_flops * res["samples_per_s_aggregate"] / 1e12
    achieved_median = 3 * fwd_flops * res["samples_per_s_median"] / 1e12
    name = torch.cuda.get_device_name(device) if cuda else ""
    peak, source = args.peak_tflops, "--peak-tflops"
    if peak <= 0:
        peak, source = known_peak_tflops(name, precision), "table: %s %s" % (name, precision)
    res.update({
        "achieved_tflops": achieved, "peak_tflops": peak if peak > 0 else None,
        "peak_tflops_source": source if peak > 0 else None, "mfu": achieved / peak if peak > 0 else None,
        "achieved_tflops_median_step": achieved_median,
        "mfu_median_step": achieved_median / peak if peak > 0 else None,
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "config_yaml": yaml.safe_dump(cfg, sort_keys=False),
    })
    res.update(environment(torch, device, name))
    if prof is not None:
        res["profile"] = {"trace": args.profile, "first_step": args.warmup + 1, "last_step": total,
                          "activities": ["cpu", "cuda"] if cuda else ["cpu"], "writer": "torch.profiler"}
        res["profiled"] = True  # the timings above include the profiler's overhead
    if job.get("padded"):
        res["padded_loss"] = job["padded"]
    if args.compile:
        # The compile happens in the first step(s): their time against the steady step is its cost. The
        # timed steps' figures above are the compiled model's steady speed.
        warm = [r["step_time_s"] for r in records[:args.warmup]]
        res["compile"] = {"mode": "default", "first_step_s": records[0]["step_time_s"], "warmup_steps_s": warm,
                          "compile_s": max(0.0, sum(warm) - len(warm) * res["step_time_s_p50"]) if warm else None,
                          "steady_step_s_p50": res["step_time_s_p50"]}
        res["implementation"] = "pytorch_compile"
    if tokens and is_llama(cfg):
        import transformers
        res["versions"]["models"] = "transformers %s %s, attention %s" % (
            transformers.__version__, LLAMAS[cfg["model"]["name"]]["arch"], "sdpa" if ATTENTION == "auto" else "eager")
    elif tokens:
        fused = ATTENTION == "auto" and hasattr(torch.nn.functional, "scaled_dot_product_attention")
        res["versions"]["models"] = "builtin (models/gpt.cpp's GPT), attention " + ("fused" if fused else "plain")
    return res


def loaded_blas():
    """The BLAS libraries mapped into this process (as tools/bench/host_info.cpp's loaded_blas)."""
    seen = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                i = line.find("/")
                path = line[i:].strip() if i >= 0 else ""
                if path and "blas" in path.rsplit("/", 1)[-1] and path not in seen:
                    seen.append(path)
    except OSError:
        pass
    return ", ".join(seen)


def environment(torch, device, name):
    versions = {"torch": torch.__version__, "models": models_source(),
                "python": platform.python_version(), "cuda": torch.version.cuda or "",
                "cudnn": str(torch.backends.cudnn.version() or "") if device.type == "cuda" else "",
                "blas": loaded_blas()}
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {"hostname": socket.gethostname(), "cpu_model": cpu_model(), "nproc": os.cpu_count(),
                 "usable_cpus": usable_cpus(), "load_avg": list(os.getloadavg())},
        "versions": versions, "device": str(device), "device_name": name,
    }
    if device.type == "cuda":
        try:
            import subprocess
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.splitlines()[0].strip()
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    return env


def describe(cfg, torch):
    """The model's state (name -> shape) and its forward FLOPs per sample, for tests/test_bench.cpp."""
    if is_gpt(cfg):  # on the meta device: GPT-2 small would take 0.5 GB and seconds to initialize
        model = build_gpt(gpt_arch(cfg), torch, torch.nn, torch.nn.functional, device="meta")
    elif is_llama(cfg):  # on the meta device but the smallest, whose FLOPs the forward hooks count
        model = build_llama(dict(lm_arch(cfg), name=cfg["model"]["name"]), torch, torch.nn,
                            device=None if cfg["model"]["name"] == "llama_tiny" else "meta")
    else:
        model = build_model(cfg, torch, torch.nn, torch.nn.functional)
    state = model.state_names() if hasattr(model, "state_names") else {k: list(v.shape) for k, v in
                                                                      model.state_dict().items()}
    return {"state": state,
            "num_parameters": sum(p.numel() for p in model.parameters()),  # a tied tensor once
            "sample_shape": sample_shape(cfg),
            "flops_per_sample_forward": forward_flops(model, sample_shape(cfg), torch, torch.nn)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="", help="the trainer's YAML config")
    ap.add_argument("--set", action="append", default=[], help="key=value, as the trainer's --set (repeatable)")
    ap.add_argument("--warmup", type=int, default=5, help="optimizer steps run first, not measured")
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    ap.add_argument("--out", default="", help="write the JSON here (default: stdout)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak TFLOP/s, for MFU")
    ap.add_argument("--models", choices=("auto", "builtin"), default="auto",
                    help="ImageNet ResNets from torchvision when importable (auto), or this file's copy")
    ap.add_argument("--attention", choices=("auto", "plain"), default="auto",
                    help="GPT attention: auto (F.scaled_dot_product_attention where torch has it, as the "
                         "trainer's automatic backend) or plain (written out)")
    ap.add_argument("--vocab-size", type=int, default=0,
                    help="a GPT's vocabulary (default: the registered model's; the trainer takes the token file's)")
    ap.add_argument("--padded-loss", choices=("full", "slice"), default="full",
                    help="a padded vocabulary's loss: over all the columns, the padding ones masked (full, nanoGPT's "
                         "cost), or over the real columns sliced off first (slice, the reference before)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model (2.0+): the result's compile object holds the compile's cost, "
                         "its timed steps the compiled model's steady speed")
    ap.add_argument("--profile", default="", help="write a Chrome trace of the timed steps (torch.profiler) here")
    ap.add_argument("--describe", action="store_true", help="print the model's state shapes and FLOPs")
    ap.add_argument("--dump-batches", default="",
                    help="data.kind synthetic with a GPT: torch.save the pool {x0, y0, x1, ...} here and exit")
    ap.add_argument("--print-defaults", action="store_true", help="print this script's copy of the defaults")
    args = ap.parse_args()
    if args.print_defaults:
        print(json.dumps(DEFAULTS, indent=2))
        return 0
    if args.warmup < 0 or args.steps < 1:
        raise ConfigError("command line: --warmup must be >= 0 and --steps >= 1")
    global MODELS, VOCAB_SIZE, ATTENTION
    MODELS = args.models
    ATTENTION = args.attention
    if args.vocab_size < 0:
        raise ConfigError("command line: --vocab-size must be >= 1 (or 0: the registered model's)")
    VOCAB_SIZE = args.vocab_size
    cfg = load_config(args.config, args.set)
    if not args.describe:
        check_mirrored(cfg)  # before the slow import of torch
    import torch
    if args.dump_batches:
        if not (is_language_model(cfg) and cfg["data"]["kind"] == "synthetic"):
            raise ConfigError("command line: --dump-batches needs a language model on data.kind synthetic")
        batches = synthetic_token_batches(cfg, lm_arch(cfg)["vocab_size"], POOL_BATCHES, torch)
        torch.save({"%s%d" % (n, i): t for i, b in enumerate(batches) for n, t in zip("xy", b)}, args.dump_batches)
        return 0
    res = describe(cfg, torch) if args.describe else run(cfg, args, torch)
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    if not args.describe:
        rate = ("%.1f tokens/s" % res["tokens_per_s_aggregate"] if "tokens_per_s_aggregate" in res
                else "%.1f samples/s" % res["samples_per_s_aggregate"])
        print("reference: %s batch %d on %s: %s by wall time over %d steps (%.2f s), step p50 %.4f s, p90 %.4f s%s%s"
              % (res["model"], res["global_batch"], res["device"], rate, res["timed_steps"], res["wall_s"],
                 res["step_time_s_p50"], res["step_time_s_p90"],
                 ", compile %.1f s" % res["compile"]["compile_s"] if res.get("compile", {}).get("compile_s") is not None
                 else "", " -> " + args.out if args.out else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print("error: %s" % e, file=sys.stderr)
        sys.exit(2)
