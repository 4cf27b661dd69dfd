// `trainer bench --decode-only`: the speed of the JPEG decoder and the transforms alone (data/pixels/jpeg.h,
// data/pixels/transforms.h) over an ImageFolder, on N threads, as one JSON result (docs/BENCHMARKS.md, "Input
// pipeline: JPEG decoding").
#pragma once

namespace trainer::bench {

/// Parses `trainer bench --decode-only --src DIR [--train|--eval] [--threads N] [--size S] [--passes K]
/// [--limit N] [--seed S] [--out FILE]` (argv[0] is "bench") and runs it. Every image file under DIR
/// (recursively, sorted by path) is read from disk and decoded to S x S RGB with the train transform
/// (RandomResizedCrop(S, scale (0.08, 1), ratio (3/4, 4/3)) + a horizontal flip, boxes from (seed, pass,
/// index)) or the eval transform (Resize(S / 0.875) + CenterCrop(S)); threads take files from a shared
/// counter. One untimed pass over the first files warms the page cache and the allocator; the timed part
/// is `passes` passes over all files. Writes images, seconds, cpu_seconds, images_per_s,
/// images_per_s_per_thread, images_per_cpu_s,
/// rss_peak_bytes, decode failures and the setup as JSON to FILE (stdout if none) and one summary line to
/// stderr. Throws std::runtime_error for a bad command line or a folder with no files.
int bench_decode_main(int argc, char** argv);

}  // namespace trainer::bench
