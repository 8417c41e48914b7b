"""Write the capstone's committed long run (``notebooks/data/capstone_long_run.json``).

Lesson 09 shows a whole run of its job: the loss per step, the validation losses, and a
sample of the text the trained model writes. The run takes most of an hour on a laptop,
so one is committed, small (no checkpoint), with how it was made. This script turns the
``--json`` of a finished ``python -m minipar train ... --save DIR`` run into that file:
it samples from DIR with the command line (the exact command is recorded), and adds the
machine, the date, the wall time and the command that trained it.

    python tools/capstone_long_run.py --run run.json --resume DIR --command "python -m ..." \
        --started 2026-01-01T00:00:00Z --ended 2026-01-01T00:45:00Z

A run made on another machine (a GPU's, say) comes with its sample and its machine:
``--sample-file`` (the sample command's output there) in place of ``--resume``, and
``--machine`` (what ran it), ``--out`` the file to write.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "notebooks" / "data" / "capstone_long_run.json"
SAMPLE = ["--prompt", "def ", "--tokens", "600", "--temperature", "0.8", "--seed", "0"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the train run's --json")
    p.add_argument("--resume", help="the train run's --save directory (sampled here)")
    p.add_argument("--sample-file", help="the sample, made where the run was")
    p.add_argument("--machine", help="what ran it (default: this machine)")
    p.add_argument("--command", required=True, help="the command that trained it")
    p.add_argument("--started", required=True, help="UTC start, ISO 8601")
    p.add_argument("--ended", required=True, help="UTC end, ISO 8601")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args()
    if (a.resume is None) == (a.sample_file is None):
        p.error("give one of --resume (sample here) and --sample-file")
    run = json.loads(Path(a.run).read_text())
    if a.sample_file:
        text = Path(a.sample_file).read_text()
    else:
        sample_cmd = [sys.executable, "-m", "minipar", "sample", "--resume", a.resume,
                      *SAMPLE]
        text = subprocess.run(sample_cmd, check=True, capture_output=True, text=True,
                              cwd=ROOT).stdout
    sys.path.insert(0, str(ROOT))
    from solutions.course import run_extent

    t0, t1 = (datetime.fromisoformat(x.replace("Z", "+00:00")) for x in (a.started, a.ended))
    out = {
        "losses": [round(x, 4) for x in run["losses"]],
        "eval": [{"step": e["step"], "loss": round(e["loss"], 4)} for e in run["eval"]],
        "sample": text.rstrip("\n"),
        **run_extent(run["config"], len(run["losses"])),
        "provenance": {
            "command": a.command,
            "sample_command": "python -m minipar sample --resume DIR " + " ".join(
                f"'{x}'" if " " in x else x for x in SAMPLE),
            "machine": a.machine or (
                f"{cpu_name()}, {os.cpu_count()} cores visible, shared with other jobs; "
                f"Python {platform.python_version()}, torch {torch.__version__.split('+')[0]}"),
            "date": a.started,
            "wall_time_s": round((t1 - t0).total_seconds()),
            "made_by": "tools/capstone_long_run.py",
        },
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out} ({Path(a.out).stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
