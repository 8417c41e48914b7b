"""Execute notebooks headless into a folder (what ``make notebooks`` runs before nbval).

``jupyter nbconvert --execute`` does the same through nbclient, but there a widget cell
now and then stalls for the whole cell timeout (180 s) after the kernel has answered:
nbclient waits for the reply with one long ``poll`` on the shell socket, and with
pyzmq's asyncio sockets a wake-up can be missed, so the poll only sees the waiting
message when it times out (it then carries on, so nothing fails: the run is just 180 s
longer). Measured here: a cell whose kernel side took 2.7 s returned after exactly the
timeout in 1 run of 3. This runner polls in half-second slices instead, so a missed
wake-up costs at most half a second; everything else is nbclient's.

    python tools/execute_notebook.py --timeout 180 --output-dir build/nbref notebooks/01_*.ipynb
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from queue import Empty

import nbformat
from nbclient import NotebookClient

SLICE_S = 0.5


def _sliced(get_msg):
    """``get_msg(timeout)`` as polls of at most ``SLICE_S`` seconds until the deadline."""
    async def get(timeout=None, **kwargs):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = SLICE_S if deadline is None else min(SLICE_S, deadline - time.monotonic())
            try:
                return await get_msg(timeout=max(0.0, left), **kwargs)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0)
    return get


class SlicedClient(NotebookClient):
    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        kc.shell_channel.get_msg = _sliced(kc.shell_channel.get_msg)
        kc.iopub_channel.get_msg = _sliced(kc.iopub_channel.get_msg)
        return kc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--timeout", type=int, default=180, help="seconds per cell")
    args = ap.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    for path in args.notebooks:
        start = time.monotonic()
        nb = nbformat.read(path, as_version=4)
        client = SlicedClient(nb, timeout=args.timeout, kernel_name="python3",
                              resources={"metadata": {"path": os.path.dirname(path) or "."}})
        try:
            client.execute()
        except Exception as e:  # a failing cell: the cell and its traceback, non-zero exit
            print(f"{path}: {type(e).__name__}\n{str(e)[-4000:]}", file=sys.stderr)
            return 1
        nbformat.write(nb, os.path.join(args.output_dir, os.path.basename(path)))
        print(f"executed {path} in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
