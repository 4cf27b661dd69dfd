"""What the benchmarks record of the host they ran on. Standard library only: imported by bench/reference.py
(whatever Python runs it, on a GPU host too) and bench/optim_quality.py."""
import platform


def cpu_model():
    """The CPU's model name from /proc/cpuinfo, else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
