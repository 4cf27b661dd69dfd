"""Reference for the IDX conversion tests: reads Fashion-MNIST's gzipped IDX files with gzip and numpy
(independently of the C++ reader) and prints, for the training images,

  sample <index> <label> <pixel sum>      for each index given on the command line
  count <class> <number of training samples of that class>
  mean <mean of all training pixels / 255>
  std <population std of all training pixels / 255>
  test <number of test images> <number of test labels> <sum of all test labels>

Usage: read_idx_data.py SRC_DIR INDEX...
"""
import gzip
import sys

import numpy as np


def read_idx(path, ndims):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[0:4], "big")
    assert magic == 0x800 | ndims, f"{path}: magic {magic:#x}"
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndims)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndims)
    assert data.size == int(np.prod(dims)), f"{path}: {data.size} bytes for dims {dims}"
    return data.reshape(dims)


def main():
    src = sys.argv[1]
    images = read_idx(f"{src}/train-images-idx3-ubyte.gz", 3)
    labels = read_idx(f"{src}/train-labels-idx1-ubyte.gz", 1)
    for arg in sys.argv[2:]:
        i = int(arg)
        print(f"sample {i} {int(labels[i])} {int(images[i].astype(np.int64).sum())}")
    for c, n in enumerate(np.bincount(labels, minlength=10)):
        print(f"count {c} {int(n)}")
    # From the histogram of pixel values: exact integer counts, then float64.
    hist = np.bincount(images.reshape(-1), minlength=256).astype(np.float64)
    values = np.arange(256, dtype=np.float64) / 255.0
    mean = (hist * values).sum() / hist.sum()
    var = (hist * (values - mean) ** 2).sum() / hist.sum()
    print(f"mean {mean:.9f}")
    print(f"std {np.sqrt(var):.9f}")
    test_images = read_idx(f"{src}/t10k-images-idx3-ubyte.gz", 3)
    test_labels = read_idx(f"{src}/t10k-labels-idx1-ubyte.gz", 1)
    print(f"test {test_images.shape[0]} {test_labels.shape[0]} {int(test_labels.astype(np.int64).sum())}")


if __name__ == "__main__":
    main()
