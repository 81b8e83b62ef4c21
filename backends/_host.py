"""What this machine offers a backend: CPU cores, the CPU's model, memory, and this process's use of it.

Facts read from the operating system (sched affinity, sysfs, cgroups,
/proc), shared by both backends: IREE sizes its CPU worker threads by
`cpu_cores` and keys its compile cache by `host_cpu`; both report
`host_memory` where a device says nothing of its own, and XLA's CPU backend
reports `process_memory`. Off Linux each falls back to what Python's standard
library knows, or to zero.
"""

from __future__ import annotations

import os
from pathlib import Path

from ._base import MemoryUse


def cpu_cores() -> int:
    """Cores this process may use: SMT siblings count once (as IREE counts), a cgroup quota caps.

    A container limited to 2 CPUs on a 64-core host sees all 64 in its affinity
    mask; 64 workers sharing 2 CPUs' worth of time would stall on each other.
    """
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux: no affinity mask, no sysfs topology, no cgroups
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, min(len(cores), cgroup_cpu_quota() or len(cores)))


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """CPUs' worth of time this process's cgroup may use (rounded up); None when unlimited."""
    try:  # cgroup v2: "max 100000" or "150000 100000" (quota and period, in microseconds)
        quota, period = (root / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:  # cgroup v1
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        return max(1, -(-int(quota) // int(period))) if int(quota) > 0 else None
    except (ValueError, ZeroDivisionError):  # "max" (v2) or garbage; v1 says -1
        return None


def host_cpu() -> str:
    """What `--iree-llvmcpu-target-cpu=host` compiles for here: the CPU's model and features.

    Code compiled for one CPU may use instructions another lacks (a cache on a
    shared disk, a copied cache directory), so the cache key names the CPU.
    """
    try:
        with open("/proc/cpuinfo") as info:
            first = info.read().split("\n\n", 1)[0]
    except OSError:  # not Linux
        import platform

        return f"{platform.machine()} {platform.processor()}"
    wanted = ("vendor_id", "model name", "flags", "Features", "CPU part")
    return "\n".join(line for line in first.splitlines() if line.startswith(wanted))


def host_memory() -> int:
    """This machine's physical memory in bytes; 0 where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def process_memory(limit: int) -> MemoryUse:
    """This process's resident memory now and at its peak (Linux and macOS; zeros elsewhere)."""
    try:
        import resource

        with open("/proc/self/statm", encoding="ascii") as statm:
            in_use = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    except (ImportError, OSError, ValueError, IndexError):
        return MemoryUse(limit=limit)
    return MemoryUse(in_use=in_use, peak=max(peak_kib * 1024, in_use), limit=limit)
