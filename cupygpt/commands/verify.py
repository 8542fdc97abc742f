"""llm.c's test_gpt2 as a command: logits, loss and every gradient against a debug state,
then K AdamW steps on its batch. Under mpiexec each rank checks its own slice."""
import math
import os

import numpy as np

from ..config.configs import VerifyConfig
from ..formats.llmc import check_finite, read_expected, read_model, read_state
from ..model.layout import copy_part, param_layout
from ..model.optim import AdamWConfig
from ..paths import make_parent
from ..precision import numerics

# Measured against llm.c's PyTorch fp32 reference (cupygpt/reference, docs/tolerances.md).
# A gradient tensor passes when max|diff| <= atol + rtol * max|reference|.
TOLERANCES = {
    "numpy": dict(logits=1e-5, loss=1e-5, grad_atol=1e-6, grad_rtol=1e-5, step_loss=1e-5),
    "cuda": dict(logits=1e-4, loss=1e-5, grad_atol=1e-5, grad_rtol=1e-4, step_loss=1e-4),
    "cuda-tf32": dict(logits=2e-2, loss=2e-3, grad_atol=1e-3, grad_rtol=5e-2, step_loss=2e-3),
    # bf16 against the fp32 reference; measured on tiny, odd and gpt2v: logits 2.1e-2, loss
    # 3.6e-4, gradients 1.13e-2 of their largest, step losses 1.3e-3 (about 1/2.5 of these)
    "numpy-bf16": dict(logits=5e-2, loss=2e-3, grad_atol=1e-4, grad_rtol=3e-2, step_loss=5e-3),
    # the same (cudasim's GEMMs add as NumPy's; a GPU's cuBLAS in another order)
    "cuda-bf16": dict(logits=5e-2, loss=2e-3, grad_atol=1e-4, grad_rtol=3e-2, step_loss=5e-3),
}


def verify(sess, on_step=None):
    """The `verify` command over a Session holding its validated VerifyConfig; returns the
    report on rank 0 (True elsewhere). on_step() is called after each AdamW step."""
    c, transport = sess.config, sess.transport
    # what validate checked and kept none of: the losses read, --trace's directory made
    expected = read_expected(c.expected) if c.expected else None
    make_parent("trace", c.trace, transport.rank == 0, c.overwrite)
    shape, params = read_model(c.model)
    check_finite(c.model, params)
    state = read_state(c.state, shape)
    run = sess.runner(shape, params, sess.step_settings(
        batch=state["B"], seq=state["T"], trace=bool(c.trace),
        adamw=AdamWConfig(lr=c.lr, weight_decay=c.weight_decay)))
    fwd_loss, logit_diff = forward_check(run, transport, state)
    loss = run.gradients(state["x"], state["y"])
    grad_diffs = gradient_check(run, transport, state, shape)
    step_losses = [loss]
    run.update()
    for _ in range(1, c.steps):
        step_losses.append(run.step(state["x"], state["y"]))
        if on_step:
            on_step()
    if c.trace:
        run.write_trace(c.trace)
    if transport.rank != 0:
        return True
    tol = TOLERANCES[numerics(sess.be, run.settings.dtype)]
    report = {
        "model": c.model, "state": c.state, "backend": numerics(sess.be, run.settings.dtype),
        "ranks": sess.mesh.size, "attention": sess.attention, "schedule": c.pipeline.schedule,
        "micro_batches": c.pipeline.micro_batches, "B": state["B"], "T": state["T"],
        "logits": {"max_abs_diff": logit_diff, "tol": tol["logits"],
                   "ok": logit_diff <= tol["logits"]},
        "loss": {"got": loss, "expected": state["loss"], "forward_only": fwd_loss,
                 "abs_diff": abs(loss - state["loss"]),
                 "ok": abs(loss - state["loss"]) <= tol["loss"]
                 and abs(fwd_loss - loss) <= tol["loss"]},
        "grads": {n: {"max_abs_diff": d, "max_abs_ref": m,
                      "tol": tol["grad_atol"] + tol["grad_rtol"] * m,
                      "ok": d <= tol["grad_atol"] + tol["grad_rtol"] * m}
                  for n, (d, m) in ((n, grad_diffs[n]) for n in param_layout(shape).names)},
        "steps": [{"step": i, "loss": l} for i, l in enumerate(step_losses)]}
    report["ok"] = (report["logits"]["ok"] and report["loss"]["ok"]
                    and all(g["ok"] for g in report["grads"].values())
                    and compare_steps(report["steps"], expected, tol))
    return report


def forward_check(run, transport, state):
    """The forward pass's loss, and the largest logit difference from the state's over
    every rank's rows and columns (its vocab shard), on rank 0."""
    diff = [0.0]

    def check_logits(rows, v0, got):
        ref = state["logits"][rows, :, v0:v0 + got.shape[-1]]
        diff[0] = max(diff[0], float(np.abs(got - ref).max()))
    loss = run.eval_loss(state["x"], state["y"], check_logits)
    return loss, max(transport.gather(diff[0]) or [0.0])


def gradient_check(run, transport, state, shape):
    """{tensor: (max |difference| from the state's gradient, max |reference|)} over every
    rank's part of it, on rank 0 (collective)."""
    mine = {}
    for part, grads in run.grads_by_part():
        lay = param_layout(shape, part)
        refv = lay.views(copy_part(np.empty(lay.size, np.float32), part, state["grads"], shape))
        for name, gh in grads.items():
            d, m = mine.get(name, (0.0, 0.0))
            mine[name] = (max(d, float(np.abs(gh - refv[name]).max())),
                          max(m, float(np.abs(refv[name]).max())))
    merged = {}
    for part in transport.gather(mine) or []:
        for name, (d, m) in part.items():
            od, om = merged.get(name, (0.0, 0.0))
            merged[name] = (max(d, od), max(m, om))
    return merged


def compare_steps(steps, expected, tol):
    """Marks each step's loss: a non-finite one fails (whatever the flags: a diverged step
    is no pass), the others against the expected losses (the validated --expected file's)
    when given; whether all hold."""
    for s in steps:
        if not math.isfinite(s["loss"]):
            s["ok"] = False
        elif expected is not None and s["step"] < len(expected):
            want = expected[s["step"]]
            s.update(expected=want, abs_diff=abs(s["loss"] - want),
                     ok=abs(s["loss"] - want) <= tol["step_loss"])
    return all(s.get("ok", True) for s in steps)


def format_report(r):
    mark = lambda ok: "OK" if ok else "FAIL"  # noqa: E731
    lines = [f"verify {r['model']} against {r['state']} (backend {r['backend']}, "
             f"{r['ranks']} rank(s), B={r['B']} T={r['T']})",
             f"logits  max|diff| {r['logits']['max_abs_diff']:.3e}  tol {r['logits']['tol']:.0e}  "
             f"{mark(r['logits']['ok'])}",
             f"loss    {r['loss']['got']:.6f}  expected {r['loss']['expected']:.6f}  "
             f"|diff| {r['loss']['abs_diff']:.3e}  {mark(r['loss']['ok'])}",
             f"{'tensor':<10}{'max|diff|':>12}{'max|ref|':>12}{'tol':>12}"]
    for n, g in r["grads"].items():
        lines.append(f"{n:<10}{g['max_abs_diff']:>12.3e}{g['max_abs_ref']:>12.3e}"
                     f"{g['tol']:>12.3e}  {mark(g['ok'])}")
    for s in r["steps"]:
        exp = (f"  expected {s['expected']:.6f}  |diff| {s['abs_diff']:.3e}  {mark(s['ok'])}"
               if "expected" in s else "" if s.get("ok", True) else "  FAIL (not finite)")
        lines.append(f"step {s['step']}: loss {s['loss']:.6f}{exp}")
    compared = sum("expected" in s for s in r["steps"])
    if compared < len(r["steps"]):  # a PASS that checked fewer steps says so
        lines.append(f"step losses: {compared} of {len(r['steps'])} compared" + (
            "" if compared else " (no --expected: the shipped losses are for the default "
                                "--lr and --weight-decay; give a file made at these)"))
    lines.append(f"verify: {'PASS' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)


def reference_defaults(kw: dict) -> dict:
    """verify's flags with --state and --expected filled in where they were not given:
    the shipped references' files beside a NAME_model.bin (its losses only at the default
    --lr and --weight-decay, which they were recorded with)."""
    kw = dict(kw)
    if kw["state"] is None:
        kw["state"] = beside(kw["model"], "_debug_state.bin")
    if kw["expected"] is None and (kw["lr"], kw["weight_decay"]) == (
            VerifyConfig.lr, VerifyConfig.weight_decay):
        kw["expected"] = beside(kw["model"], "_expected.json")
    return kw


def beside(model, suffix):
    """NAME + suffix beside a NAME_model.bin (the shipped references have a debug state and
    the losses of its steps at the default --lr and --weight-decay), or None."""
    stem = model.removesuffix("_model.bin")
    return stem + suffix if stem != model and os.path.isfile(stem + suffix) else None
