"""Probe: the cost of accumulating a stage's bf16 weight gradients into fp32 sums."""
import json
import os

import torch

dev = "cuda"
torch.manual_seed(0)
h, f, layers, tokens = 2048, 8192, 6, 4096
shapes = [(3 * h, h), (h, h), (f, h), (h, f)] * layers
n = sum(a * b for a, b in shapes)
x = {s: torch.randn(tokens, s[1], device=dev, dtype=torch.bfloat16) for s in set(shapes)}
dy = {s: torch.randn(tokens, s[0], device=dev, dtype=torch.bfloat16) for s in set(shapes)}
g16 = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
acc32 = [torch.zeros(s, device=dev) for s in shapes]
acc16 = [torch.zeros(s, device=dev, dtype=torch.bfloat16) for s in shapes]
flat32 = torch.zeros(n, device=dev)

def timeit(fn, reps=16):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps

out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "elements": n}
out["add fp32+=bf16"] = timeit(lambda: [a.add_(g) for a, g in zip(acc32, g16)])
out["add bf16+=bf16"] = timeit(lambda: [a.add_(g) for a, g in zip(acc16, g16)])
out["add fp32+=fp32(cast)"] = timeit(lambda: [a.add_(g.float()) for a, g in zip(acc32, g16)])
out["foreach fp32+=bf16"] = timeit(lambda: torch._foreach_add_(acc32, g16))
out["foreach bf16+=bf16"] = timeit(lambda: torch._foreach_add_(acc16, g16))
out["copy fp32<-bf16"] = timeit(lambda: [a.copy_(g) for a, g in zip(acc32, g16)])
out["wgrad mm bf16"] = timeit(lambda: [torch.mm(dy[s].t(), x[s]) for s in shapes])
out["wgrad mm + add fp32"] = timeit(
    lambda: [a.add_(torch.mm(dy[s].t(), x[s])) for a, s in zip(acc32, shapes)])
out["wgrad mm + add bf16"] = timeit(
    lambda: [a.add_(torch.mm(dy[s].t(), x[s])) for a, s in zip(acc16, shapes)])
try:
    out["wgrad addmm out_dtype fp32 inplace"] = timeit(lambda: [
        torch.addmm(a, dy[s].t(), x[s], out_dtype=torch.float32, out=a)
        for a, s in zip(acc32, shapes)])
    a, s = acc32[0].zero_(), shapes[0]
    torch.addmm(a, dy[s].t(), x[s], out_dtype=torch.float32, out=a)
    torch.addmm(a, dy[s].t(), x[s], out_dtype=torch.float32, out=a)
    ref = 2 * (dy[s].float().t() @ x[s].float())
    out["addmm inplace rel err"] = ((a - ref).norm() / ref.norm()).item()
    out["wgrad mm out_dtype fp32"] = timeit(lambda: [
        torch.mm(dy[s].t(), x[s], out_dtype=torch.float32) for s in shapes])
except Exception as e:
    out["addmm error"] = repr(e)[:300]
print(json.dumps(out, indent=1))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "accum.json"), "w"), indent=1)
