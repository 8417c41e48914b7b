"""minipar: a compact reference engine for data, tensor and pipeline parallelism."""

import sys

from minipar.startup import hold_interrupts

# ``python -m minipar`` imports this package first ("-m" is sys.argv[0] until Python has
# found the module it runs): a Ctrl-C from here to the end of its imports is kept and
# ends the program in one line (``minipar/startup.py``; ``__main__`` releases it)
hold_interrupts(sys.argv[:1] == ["-m"])

from minipar.comm import Comm, CommLog  # noqa: E402
from minipar.launch import LaunchError, RankDied, RankFailed, RankTimeout, launch  # noqa: E402
from minipar.mesh import Mesh, RankMesh  # noqa: E402
from minipar.model import GPT, PRESETS, GPTConfig  # noqa: E402

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "Comm", "CommLog", "Mesh", "RankMesh", "launch",
    "LaunchError", "RankFailed", "RankDied", "RankTimeout",
]
__version__ = "0.1.0"
