"""Fails when the environment holds a package that requirements/lock.txt does not pin, or another version of one
that it does: a dependency added to pyproject.toml without `make lock` would otherwise install unpinned."""

import sys
from importlib.metadata import distributions

from packaging.utils import canonicalize_name

UNPINNED = {"vcpo", "torch", "pip", "setuptools", "wheel"}  # the package itself, the CPU torch, the installers


def main(lock_path: str) -> int:
    pins = {}
    for line in open(lock_path):
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            pins[canonicalize_name(name)] = version
    problems = []
    for dist in distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in UNPINNED:
            continue
        if name not in pins:
            problems.append(f"{name} {dist.version} is installed but not pinned")
        elif pins[name] != dist.version:
            problems.append(f"{name} {dist.version} is installed, {lock_path} pins {pins[name]}")
    for problem in problems:
        print(f"error: {problem}; run `make lock` after changing pyproject.toml's dependencies", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
