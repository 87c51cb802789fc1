"""The machine a device check ran on, as the host record of benches/report.py (CPU, cores,
Python, numpy, torch) plus the GPU (name, memory, CUDA version, driver), glibc, hardware
threads per core, the versions of the packages the CUDA tests drive (transformers, Lightning,
mpi4py: a model class's layout differs between transformers releases), and which hetcoll was
imported (the wheel's, abi3).

    python benches/device/environment.py --json OUT/environment.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benches/: report.host_info

from report import host_info


def threads_per_core() -> int | None:
    """Hardware threads per core (2 with SMT), from cpu0's siblings in sysfs; None where the
    file is absent. One-thread CPU ranks on two threads of one core share its units: one
    reason ranks side by side run at unequal speeds."""
    path = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


#: Packages whose versions a device run records (None where one is not installed).
PACKAGES = ("transformers", "lightning", "mpi4py", "pytest")


def package_versions() -> dict[str, str | None]:
    """Each of :data:`PACKAGES`' installed version, read from its metadata (not imported)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def environment() -> dict[str, Any]:
    import torch

    import hetcoll

    host = host_info()
    host["glibc"] = "-".join(platform.libc_ver())
    host["threads_per_core"] = threads_per_core()
    host["packages"] = package_versions()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        host["gpu"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
        host["cuda"] = torch.version.cuda
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            host["driver"] = smi.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            host["driver"] = None
    else:
        host["gpu"] = "none (no CUDA: dry run)"
    core = Path(hetcoll._core.__file__).name
    return {
        "host": host,
        "cuda": torch.cuda.is_available(),
        "hetcoll": {"path": hetcoll.__file__, "core": core, "abi3": core.endswith(".abi3.so")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    env = environment()
    Path(args.json).write_text(json.dumps(env, indent=1) + "\n")
    print(json.dumps(env, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
