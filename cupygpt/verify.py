"""llm.c's test_gpt2 as a command: logits, loss and every gradient against a debug state,
then K AdamW steps on its batch. Under mpiexec each rank checks its own slice."""
import numpy as np

from .files import read_model, read_state
from .layout import copy_part, param_layout
from .optim import AdamWConfig
from .parallel.pipeline import trace

# Measured against llm.c's PyTorch fp32 reference (cupygpt/reference, README "Tolerances").
# A gradient tensor passes when max|diff| <= atol + rtol * max|reference|.
TOLERANCES = {
    "numpy": dict(logits=1e-5, loss=1e-5, grad_atol=1e-6, grad_rtol=1e-5, step_loss=1e-5),
    "cuda": dict(logits=1e-4, loss=1e-5, grad_atol=1e-5, grad_rtol=1e-4, step_loss=1e-4),
    "cuda-tf32": dict(logits=2e-2, loss=2e-3, grad_atol=1e-3, grad_rtol=5e-2, step_loss=2e-3),
}


def verify(sess):
    """The `verify` command over a Session holding its validated VerifyConfig; returns the
    report on rank 0 (True elsewhere)."""
    c, tr, mesh = sess.config, sess.tr, sess.mesh
    cfg, params = read_model(c.model)
    st = read_state(c.state, cfg)
    B, T = st["B"], st["T"]
    run = sess.runner(cfg, params, B, T, np.dtype(c.dtype).type,
                      AdamWConfig(lr=c.lr, weight_decay=c.weight_decay))
    if c.trace:
        run.start_trace()
    key = sess.be.numerics()
    tol = TOLERANCES[key]

    logit_diff = [0.0]

    def check_logits(mb, logits):  # this rank's rows, and columns (its vocab shard)
        head = run.head
        got = sess.be.to_host(logits)[..., :head.valid]
        ref = st["logits"][run.rows(mb), :, head.v0:head.v0 + head.valid]
        logit_diff[0] = max(logit_diff[0], float(np.abs(got - ref).max()))

    fwd_loss = run.eval_loss(st["x"], st["y"], check_logits)
    logit_diff = max(tr.gather(logit_diff[0]) or [0.0])  # every shard's columns
    loss = run.gradients(st["x"], st["y"])

    mine = {}
    for stage in run.stages:
        grads = stage.g
        if not run.summed:  # ZeRO-1 sums the replicas' gradients inside the optimizer step
            whole = stage.grads.copy()
            tr.all_reduce(whole, "dp")
            grads = stage.layout.views(whole)
        ref = copy_part(np.empty(stage.layout.size, np.float32), stage.part, st["grads"], cfg)
        refv = stage.layout.views(ref)
        for name, g in grads.items():
            gh = sess.be.to_host(g)
            d, m = mine.get(name, (0.0, 0.0))
            mine[name] = (max(d, float(np.abs(gh - refv[name]).max())),
                          max(m, float(np.abs(refv[name]).max())))
    merged = {}
    for part in tr.gather(mine) or []:
        for name, (d, m) in part.items():
            od, om = merged.get(name, (0.0, 0.0))
            merged[name] = (max(d, od), max(m, om))

    step_losses = [loss]
    run.optimizer_step()
    for _ in range(1, c.steps):
        step_losses.append(run.train_step(st["x"], st["y"]))
    if c.trace:
        trace.write(run, c.trace)
    if tr.rank != 0:
        return True

    grads = {n: {"max_abs_diff": d, "max_abs_ref": m,
                 "tol": tol["grad_atol"] + tol["grad_rtol"] * m,
                 "ok": d <= tol["grad_atol"] + tol["grad_rtol"] * m}
             for n, (d, m) in ((n, merged[n]) for n in param_layout(cfg).names)}
    report = {
        "model": c.model, "state": c.state, "backend": key, "ranks": mesh.size,
        "schedule": c.pipeline.schedule, "micro_batches": c.pipeline.micro_batches,
        "B": B, "T": T,
        "logits": {"max_abs_diff": logit_diff, "tol": tol["logits"],
                   "ok": logit_diff <= tol["logits"]},
        "loss": {"got": loss, "expected": st["loss"], "forward_only": fwd_loss,
                 "abs_diff": abs(loss - st["loss"]),
                 "ok": abs(loss - st["loss"]) <= tol["loss"] and abs(fwd_loss - loss) <= tol["loss"]},
        "grads": grads, "steps": [{"step": i, "loss": l} for i, l in enumerate(step_losses)],
    }
    ok = report["logits"]["ok"] and report["loss"]["ok"] and all(g["ok"] for g in grads.values())
    if c.expected is not None:
        exp = c.expected_losses
        for s in report["steps"]:
            if s["step"] < len(exp):
                s.update(expected=exp[s["step"]], abs_diff=abs(s["loss"] - exp[s["step"]]),
                         ok=abs(s["loss"] - exp[s["step"]]) <= tol["step_loss"])
                ok = ok and s["ok"]
    report["ok"] = ok
    return report


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
               if "expected" in s else "")
        lines.append(f"step {s['step']}: loss {s['loss']:.6f}{exp}")
    lines.append(f"verify: {'PASS' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)
