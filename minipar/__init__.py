"""minipar: a compact reference engine for data, tensor and pipeline parallelism."""

import sys

from minipar.startup import interrupt_kept

# ``python -m minipar`` imports this package first: "-m" is sys.argv[0] until Python has
# found the module it runs, so a Ctrl-C while torch loads ends the program in one line
with interrupt_kept(sys.argv[:1] == ["-m"]):
    from minipar.comm import Comm, CommLog
    from minipar.launch import LaunchError, RankDied, RankFailed, RankTimeout, launch
    from minipar.mesh import Mesh, RankMesh
    from minipar.model import GPT, PRESETS, GPTConfig

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "Comm", "CommLog", "Mesh", "RankMesh", "launch",
    "LaunchError", "RankFailed", "RankDied", "RankTimeout",
]
__version__ = "0.1.0"
