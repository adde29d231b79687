"""Does a copy between GPU buffers need a multiprocessor? (docs/design.md, "Ranks sharing a GPU")

A kernel that holds every SM of GPU 0 for about a second runs on one stream; 50 ms after it
starts, a 256 MiB copy is issued on another stream, (a) between two buffers of GPU 0 and (b)
from GPU 0 to GPU 1 (peer access, as the ops' pushes over NVLink). A copy that takes about as
long as alone was moved by a copy engine; one that ends much later waited for SMs (the kernel
may run in several waves of CTAs: a waiting copy then runs between two waves).

    python bench/probe_copy_sm.py [--out probe.json]
"""
import argparse
import json
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _spin(out_ptr, iters):
    x = tl.program_id(0).to(tl.float32)
    for _ in range(iters):
        x = x * 0.999999 + 1.0
    tl.store(out_ptr + tl.program_id(0), x)


def _hold_sms(iters, out):
    # 16 CTAs of 128 threads per SM: every SM's 2048 thread slots, so nothing else fits beside.
    _spin[(out.numel(),)](out, iters, num_warps=4)


def _wait(ev, t0):
    while not ev.query():
        time.sleep(0.0005)
    return time.perf_counter() - t0


def probe(dst, src, iters, out):
    spin_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    spun, copied = torch.cuda.Event(), torch.cuda.Event()
    # The copy alone (the GPU otherwise idle), for comparison.
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    alone = time.perf_counter() - t
    t0 = time.perf_counter()
    with torch.cuda.stream(spin_stream):
        _hold_sms(iters, out)
        spun.record()
    time.sleep(0.05)
    t_issue = time.perf_counter() - t0
    with torch.cuda.stream(copy_stream):
        dst.copy_(src)
        copied.record()
    t_copy = _wait(copied, t0)
    t_spin = _wait(spun, t0)
    torch.cuda.synchronize()
    # Held back: the copy took far longer than alone (it ran only once SMs came free).
    return {"copy_alone_s": round(alone, 4), "copy_issued_s": round(t_issue, 4), "copy_done_s": round(t_copy, 4),
            "kernel_done_s": round(t_spin, 4), "copy_held_back": t_copy - t_issue > 10 * alone + 0.005}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * 16, device="cuda:0")
    # Calibrate the spin to about one second.
    iters = 1 << 16
    _hold_sms(iters, out)
    torch.cuda.synchronize()
    t = time.perf_counter()
    _hold_sms(iters, out)
    torch.cuda.synchronize()
    iters = max(1, int(iters * 1.0 / (time.perf_counter() - t)))
    n = 128 << 20  # bf16 elements: 256 MiB
    src = torch.randn(n, device="cuda:0").to(torch.bfloat16)
    res = {"device": torch.cuda.get_device_name(0), "sms": sms, "bytes": n * 2,
           "same_gpu": probe(torch.empty_like(src), src, iters, out)}
    if torch.cuda.device_count() > 1:
        res["to_peer_gpu"] = probe(torch.empty_like(src, device="cuda:1"), src, iters, out)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python bench/probe_copy_sm.py", "result": res}, f, indent=1)


if __name__ == "__main__":
    main()
