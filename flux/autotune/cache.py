"""The persistent cache of tuned choices, one JSON file per topology.

Location: $FLUX_CACHE_DIR, else ~/.cache/flux/. File: tune-<hash of the topology key>.json:

    {"format": 1, "flux": "<version>", "topology": "<key>", "entries": {
        "<problem key>": {"choice": "<candidate label>", "default": "<label>",
                          "times_ms": {"<label>": t, ...}}}}

A file of another format, flux version or topology is ignored (never half-trusted). Shipped
defaults for measured topologies live in flux/autotune/shipped/ in the same format and are
consulted after the user's cache.
"""
import hashlib
import json
import os
import tempfile
from typing import Dict, Optional

from flux import envs
from flux._version import __version__

FORMAT = 1
# Moves on every change of any loaded cache, so that remembered choices are recomputed.
GENERATION = [0]
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped")


def cache_dir() -> str:
    return envs.CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "flux")


def file_name(topology_key: str) -> str:
    return "tune-" + hashlib.sha1(topology_key.encode()).hexdigest()[:16] + ".json"


def problem_key(op: str, m_bucket: int, n: int, k: int, dtype: str, world: int, weight_layout: str) -> str:
    return f"{op}|{dtype}|w{world}|m{m_bucket}|n{n}|k{k}|{weight_layout}"


def _load(path: str, topology_key: str, check_version: bool) -> Dict[str, dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if data.get("format") != FORMAT or data.get("topology") != topology_key:
        return {}
    if check_version and data.get("flux") != __version__:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


class TuneCache:
    """Entries for one topology: the user's file over the shipped defaults."""

    def __init__(self, topology_key: str, directory: Optional[str] = None):
        self.topology_key = topology_key
        self.path = os.path.join(directory or cache_dir(), file_name(topology_key))
        self.shipped = _load(os.path.join(SHIPPED_DIR, file_name(topology_key)), topology_key, check_version=False)
        self.user = _load(self.path, topology_key, check_version=True)

    def get(self, key: str) -> Optional[dict]:
        return self.user.get(key) or self.shipped.get(key)

    def put(self, key: str, entry: dict) -> None:
        self.user[key] = entry
        GENERATION[0] += 1

    def save(self, path: Optional[str] = None) -> str:
        """Write the user's entries (atomically: a reader never sees half a file)."""
        path = path or self.path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = {"format": FORMAT, "flux": __version__, "topology": self.topology_key, "entries": self.user}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tune-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        return path
