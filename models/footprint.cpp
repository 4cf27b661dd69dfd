#include "models/footprint.h"

#include <algorithm>
#include <numeric>

namespace models {

int64_t Footprint::parameter_count() const {
  return std::accumulate(parameters.begin(), parameters.end(), int64_t{0});
}

int64_t Footprint::largest_parameter() const {
  return parameters.empty() ? 0 : *std::max_element(parameters.begin(), parameters.end());
}

namespace {

// A layer's parameters: a weight of `weight` elements and, when `bias` > 0, a bias of that many.
void add_layer(Footprint& f, int64_t weight, int64_t bias = 0) {
  f.parameters.push_back(weight);
  if (bias > 0) f.parameters.push_back(bias);
}

// BatchNorm2d(c): weight and bias; running mean, running variance and the batch counter.
void add_batch_norm(Footprint& f, int64_t c) {
  add_layer(f, c, c);
  f.buffers += 2 * c + 1;
}

// A 3x3 (padding 1) or 1x1 (padding 0) convolution, or the ImageNet stem's 7x7 (padding 3), with `stride`.
int64_t conv_out(int64_t side, int64_t stride) { return (side - 1) / stride + 1; }

// One transformer block's activations per token and its backward's largest transient per token.
struct BlockCount {
  double kept = 0;       ///< kept for backward, the block's input included
  double transient = 0;  ///< held beside them while the block's backward runs
};

// GPT's and ViT's block (attention.cpp): per token, LayerNorm keeps its input (x) and ln_1's output is kept
// by c_attn; q, k and v are views of c_attn's output (3C); the attention keeps its output and one
// log-sum-exp per head (fused; the output, heads side by side, is c_proj's input) or its probabilities, nh x
// T per token, and c_proj keeps the heads copied side by side (C) (plain); the residual sum h (C) is ln_2's input, whose output (C) c_fc keeps; c_fc's output
// (4C, GELU's input) and GELU's output (4C, c_proj's input). Four LayerNorm statistics. Dropout above 0
// keeps a mask per dropout.
BlockCount transformer_block(int64_t C, int64_t nh, int64_t T, int64_t mlp_ratio, double dropout, bool fused) {
  const double c = static_cast<double>(C), hidden = static_cast<double>(mlp_ratio * C);
  // Fused, the kernel's output is laid out heads side by side already (c_proj reads it as it is); plain,
  // the heads are copied side by side from the product of the probabilities and the values.
  const double attention = fused ? c + static_cast<double>(nh) : static_cast<double>(nh * T) + c;
  BlockCount b;
  b.kept = c /*x*/ + c /*ln_1*/ + 3 * c /*qkv*/ + attention + c /*h*/ + c /*ln_2*/ + 2 * hidden + 4;
  if (dropout > 0) b.kept += 2 * c + (fused ? 0.0 : static_cast<double>(nh * T));
  // Backward through the MLP: the residual stream's gradient and the gradients of c_fc's and GELU's outputs.
  b.transient = c + 2 * hidden;
  return b;
}

// Llama's block (llama.cpp): RMSNorm keeps its input, the normalized tensor and its output (the projections'
// input); the rotated queries (q) and keys (kv) and the values (kv) go to the attention, which keeps them with
// its output (q, o_proj's input as it is) and a log-sum-exp per head when fused and reading grouped heads
// itself; plain, it keeps the repeated keys and values (q each) and the probabilities (nh x T), and o_proj
// keeps the heads copied side by side (q);
// the residual sum (C) and the second RMSNorm (2C more); SwiGLU keeps gate's and up's outputs, SiLU's output
// and their product (4I).
BlockCount llama_block(const LlamaOptions& o, int64_t T, bool fused) {
  const double c = static_cast<double>(o.n_embd()), q = static_cast<double>(o.n_head() * o.head_size());
  const double kv = static_cast<double>(o.kv_heads() * o.head_size()), I = static_cast<double>(o.intermediate_size());
  const double nh = static_cast<double>(o.n_head());
  // The heads side by side (o_proj's input): the fused kernel's output as it is, or a copy (plain).
  const double attention = fused ? q + 2 * kv + q + nh : q + 2 * q + nh * static_cast<double>(T) + q;
  BlockCount b;
  b.kept = 3 * c /*norm*/ + 2 + attention + c /*h*/ + 2 * c /*norm*/ + 2 + 4 * I;
  if (o.dropout() > 0) b.kept += fused ? 0.0 : nh * static_cast<double>(T);
  // Backward: the residual stream's gradient, SwiGLU's gradients, and in plain attention the gradients of
  // the probabilities and of the scores (nh x T each).
  b.transient = c + 3 * I + (fused ? 0.0 : 2 * nh * static_cast<double>(T));
  return b;
}

// A language model's head per token: the last block's output and the final norm's (`norm` elements), the
// log-probabilities the loss keeps (V, float32), and at the start of backward the gradients of the
// log-probabilities and of the logits (2V, and the padded width's when the model pads its vocabulary).
void language_head(Footprint& f, double T, double norm, int64_t V, int64_t padded, const BlockCount& block,
                   int64_t n_layer, double embedding) {
  const double v = static_cast<double>(V), vp = static_cast<double>(padded);
  const double head = norm + v;
  f.saved = T * (embedding + static_cast<double>(n_layer) * block.kept + head);
  f.saved_float32 = T * v;
  // Every block recomputed: the caller adds the other blocks' inputs (C per token each).
  f.saved_checkpointed = T * (embedding + head + block.kept);
  const double head_transient = 2 * v + (padded != V ? vp : 0.0);
  // At the start of backward everything is kept and the logits' gradients exist; once the head's backward
  // has run, its log-probabilities are gone and a block's own gradients are what is held.
  f.transient = T * std::max(head_transient, block.transient - v);
}

}  // namespace

Footprint resnet_footprint(const ResNetOptions& o, const std::vector<int64_t>& shape) {
  Footprint f;
  const bool imagenet = o.stem() == StemKind::imagenet;
  const int64_t k = imagenet ? 7 : 3;
  int64_t channels = o.widths()[0];
  add_layer(f, o.in_channels() * channels * k * k);
  add_batch_norm(f, channels);
  // The stem: the convolution's output (BatchNorm's input) and ReLU's; ImageNet's max pool keeps its output
  // (the first block's input) and its indices (int64: two float32 elements each).
  int64_t h = conv_out(shape.at(1), imagenet ? 2 : 1), w = conv_out(shape.at(2), imagenet ? 2 : 1);
  double stem = 2.0 * static_cast<double>(channels * h * w);
  double largest_map = static_cast<double>(channels * h * w);
  if (imagenet) {
    h = conv_out(h, 2);
    w = conv_out(w, 2);
    stem += 3.0 * static_cast<double>(channels * h * w);
  }
  double blocks = 0, outputs = 0, largest_block = 0;
  for (size_t s = 0; s < o.layers().size(); ++s) {
    for (int64_t b = 0; b < o.layers()[s]; ++b) {
      const int64_t planes = o.widths()[s], stride = s > 0 && b == 0 ? 2 : 1;
      const int64_t expansion = o.block() == BlockKind::basic ? 1 : 4, out = planes * expansion;
      const int64_t h2 = conv_out(h, stride), w2 = conv_out(w, stride);
      const double map = static_cast<double>(h2 * w2);
      // Each convolution's output (its BatchNorm's input) and each ReLU's output (the next convolution's
      // input, or the block's output); BatchNorm's own output is freed once ReLU or the sum has read it.
      double kept = 0;
      if (o.block() == BlockKind::basic) {
        add_layer(f, channels * planes * 9);
        add_batch_norm(f, planes);
        add_layer(f, planes * planes * 9);
        add_batch_norm(f, planes);
        kept = 4.0 * static_cast<double>(planes) * map;
      } else {
        add_layer(f, channels * planes);
        add_batch_norm(f, planes);
        add_layer(f, planes * planes * 9);
        add_batch_norm(f, planes);
        add_layer(f, planes * out);
        add_batch_norm(f, out);
        kept = 2.0 * static_cast<double>(planes * h * w) + 2.0 * static_cast<double>(planes) * map +
               2.0 * static_cast<double>(out) * map;
      }
      const bool reshapes = stride != 1 || channels != out;
      if (reshapes && o.shortcut() == ShortcutKind::projection) {
        add_layer(f, channels * out);  // the 1x1 projection, and its BatchNorm
        add_batch_norm(f, out);
        kept += static_cast<double>(out) * map;
      }
      blocks += kept;
      outputs += static_cast<double>(out) * map;
      largest_block = std::max(largest_block, kept);
      // The largest feature map: the block's output, or a bottleneck's first 1x1 output at the input's size.
      const double first = o.block() == BlockKind::basic ? 0.0 : static_cast<double>(planes * h * w);
      largest_map = std::max({largest_map, static_cast<double>(out) * map, first});
      channels = out;
      h = h2;
      w = w2;
    }
  }
  add_layer(f, channels * o.num_classes(), o.num_classes());
  const double head = static_cast<double>(channels) + 2.0 * static_cast<double>(o.num_classes());
  f.saved = stem + blocks + head;
  f.saved_checkpointed = stem + outputs + largest_block + head;
  f.saved_float32 = 0;
  // Backward through a convolution and its BatchNorm at the largest map: two gradients of its size at once.
  f.transient = 2.0 * largest_map;
  return f;
}

Footprint plain_cnn_footprint(const PlainCnnOptions& o, const std::vector<int64_t>& shape) {
  Footprint f;
  int64_t c = o.width(), h = shape.at(1), w = shape.at(2);
  add_layer(f, o.in_channels() * c * 9, c);
  const double stem = 2.0 * static_cast<double>(c * h * w);  // the convolution's output and ReLU's
  double blocks = 0, outputs = 0, largest_block = 0, largest_map = static_cast<double>(c * h * w);
  for (int64_t i = 0; i < o.depth(); ++i) {
    add_layer(f, 2 * c * c * 9, 2 * c);
    h = conv_out(h, 2);
    w = conv_out(w, 2);
    c *= 2;
    const double map = static_cast<double>(c * h * w);
    blocks += 2.0 * map;
    outputs += map;
    largest_block = std::max(largest_block, 2.0 * map);
    largest_map = std::max(largest_map, map);
  }
  add_layer(f, c * o.num_classes(), o.num_classes());
  const double head = static_cast<double>(c) + 2.0 * static_cast<double>(o.num_classes());
  f.saved = stem + blocks + head;
  f.saved_checkpointed = stem + outputs + largest_block + head;
  f.transient = 2.0 * largest_map;
  return f;
}

Footprint gpt_footprint(const GPTOptions& o, const std::vector<int64_t>& shape, bool fused) {
  Footprint f;
  const int64_t C = o.n_embd(), m = o.vocab_multiple(), Vp = (o.vocab_size() + m - 1) / m * m;
  const int64_t ratio = TransformerBlockOptions(C, o.n_head()).mlp_ratio();
  add_layer(f, Vp * C);           // wte (tied: also the output projection)
  f.tied = Vp * C;
  add_layer(f, o.context() * C);  // wpe
  for (int64_t i = 0; i < o.n_layer(); ++i) {
    add_layer(f, C, C);                          // ln_1
    add_layer(f, 3 * C * C, 3 * C);              // c_attn
    add_layer(f, C * C, C);                      // attn.c_proj
    add_layer(f, C, C);                          // ln_2
    add_layer(f, ratio * C * C, ratio * C);      // c_fc
    add_layer(f, C * ratio * C, C);              // mlp.c_proj
    f.linears.insert(f.linears.end(), {{"c_attn", C, 3 * C}, {"c_proj", C, C}, {"c_fc", C, ratio * C}, {"c_proj", ratio * C, C}});
  }
  add_layer(f, C, C);  // ln_f
  const int64_t T = shape.at(0);
  const BlockCount block = transformer_block(C, o.n_head(), T, ratio, o.dropout(), fused);
  // The embeddings' sum (block 0's input) is counted by the block; dropout on it keeps a mask.
  const double embedding = o.dropout() > 0 ? static_cast<double>(C) : 0.0;
  language_head(f, static_cast<double>(T), 2.0 * static_cast<double>(C) + 2, o.vocab_size(), Vp, block, o.n_layer(),
                embedding);
  f.saved_checkpointed += static_cast<double>(T) * static_cast<double>(o.n_layer() - 1) * static_cast<double>(C);
  return f;
}

Footprint llama_footprint(const LlamaOptions& o, const std::vector<int64_t>& shape, bool fused) {
  Footprint f;
  const int64_t C = o.n_embd(), q = o.n_head() * o.head_size(), kv = o.kv_heads() * o.head_size();
  const int64_t I = o.intermediate_size(), bias = o.qkv_bias() ? 1 : 0;
  add_layer(f, o.vocab_size() * C);  // embed_tokens
  for (int64_t i = 0; i < o.n_layer(); ++i) {
    add_layer(f, C);                    // input_layernorm
    add_layer(f, q * C, bias * q);      // q_proj
    add_layer(f, kv * C, bias * kv);    // k_proj
    add_layer(f, kv * C, bias * kv);    // v_proj
    add_layer(f, C * q);                // o_proj
    add_layer(f, C);                    // post_attention_layernorm
    add_layer(f, I * C);                // gate_proj
    add_layer(f, I * C);                // up_proj
    add_layer(f, C * I);                // down_proj
    f.linears.insert(f.linears.end(), {{"q_proj", C, q}, {"k_proj", C, kv}, {"v_proj", C, kv}, {"o_proj", q, C},
                                       {"gate_proj", C, I}, {"up_proj", C, I}, {"down_proj", I, C}});
  }
  add_layer(f, C);  // norm
  if (!o.tie_embeddings()) add_layer(f, C * o.vocab_size());  // lm_head
  else f.tied = o.vocab_size() * C;
  const int64_t T = shape.at(0);
  const BlockCount block = llama_block(o, T, fused);
  language_head(f, static_cast<double>(T), 3.0 * static_cast<double>(C) + 2, o.vocab_size(), o.vocab_size(), block,
                o.n_layer(), 0.0);
  f.saved_checkpointed += static_cast<double>(T) * static_cast<double>(o.n_layer() - 1) * static_cast<double>(C);
  return f;
}

Footprint vit_footprint(const ViTOptions& o, const std::vector<int64_t>& shape, bool fused) {
  (void)shape;  // the architecture fixes the input size (ViTImpl checks it)
  Footprint f;
  const int64_t C = o.n_embd(), p = o.patch_size(), side = o.image_size() / p, N = side * side, T = N + 1;
  const int64_t ratio = TransformerBlockOptions(C, o.n_head()).mlp_ratio();
  add_layer(f, C * o.in_channels() * p * p, C);  // patch_embed
  add_layer(f, C);                               // cls_token
  add_layer(f, T * C);                           // pos_embed
  for (int64_t i = 0; i < o.n_layer(); ++i) {
    add_layer(f, C, C);
    add_layer(f, 3 * C * C, 3 * C);
    add_layer(f, C * C, C);
    add_layer(f, C, C);
    add_layer(f, ratio * C * C, ratio * C);
    add_layer(f, C * ratio * C, C);
  }
  add_layer(f, C, C);                                          // ln_f
  add_layer(f, o.num_classes() * C, o.num_classes());          // head
  const BlockCount block = transformer_block(C, o.n_head(), T, ratio, o.dropout(), fused);
  const double t = static_cast<double>(T), c = static_cast<double>(C), L = static_cast<double>(o.n_layer());
  // Outside the blocks: ln_f's input (the last block's output) and output, and its statistics; the class
  // token's logits and their log-probabilities.
  const double head = t * (2 * c + 2) + 2.0 * static_cast<double>(o.num_classes());
  f.saved = t * L * block.kept + head;
  f.saved_checkpointed = t * L * c + t * block.kept + head;
  f.transient = t * block.transient;
  return f;
}

}  // namespace models
