"""minipar: a compact reference engine for data, tensor and pipeline parallelism."""

from minipar.comm import Comm, CommLog
from minipar.launch import LaunchError, RankDied, RankFailed, RankTimeout, launch
from minipar.mesh import Mesh, RankMesh
from minipar.model import GPT, PRESETS, GPTConfig

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "Comm", "CommLog", "Mesh", "RankMesh", "launch",
    "LaunchError", "RankFailed", "RankDied", "RankTimeout",
]
__version__ = "0.1.0"
