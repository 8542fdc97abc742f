"""A stage's LM head: logits = lnf wte^T a chunk of positions at a time (layout's
LOGIT_CHUNK bounds a chunk), and the vocab-parallel softmax cross-entropy on each chunk.

In training the head's backward runs here too, while a chunk's dlogits exist, so no
(B, T, Vp) tensor is ever kept: what a stage keeps of the head is lnf, and after a
training forward lnf's gradient in its place. The stage's backward starts from there.
"""


def lm_head(st, lnf, losses, targets, dloss, on_logits, first=0):
    """The head of Stage st over lnf's positions (N, C), a chunk of the scratch's logit
    rows at a time: with targets the losses (dlogits in place of the logits with dloss);
    with dloss also wte's gradient += dlogits^T lnf, then lnf's rows := dlogits wte (a
    partial sum over the vocab shards: backward sums it over the group). In bf16 each
    chunk's addition to wte's gradient is rounded, as each micro-batch's is.
    on_logits(first + r0, logits): chunk r0's logits, as the GEMM made them."""
    if targets is None and on_logits is None:
        return  # nobody reads them
    be, p, s, N = st.be, st.p, st.s, lnf.shape[0]
    R, Vr = s["logits"].shape
    for r0 in range(0, N, R):
        n, rows = min(R, N - r0), slice(r0, r0 + R)
        logits = s["logits"].reshape(-1)[:n * Vr].reshape(n, Vr)
        be.matmul_forward(logits, lnf[rows], p["wte"])
        if on_logits is not None:
            on_logits(first + r0, logits)
        if targets is None:
            continue
        cross_entropy(st, logits, losses[rows], targets[rows], dloss)
        if dloss is not None:
            be.matmul_backward_weight(st.g["wte"], None, logits, lnf[rows])
            be.matmul_backward_input(lnf[rows], logits, p["wte"])


def cross_entropy(st, logits, losses, targets, dloss):
    """Vocab-parallel softmax cross-entropy of one chunk: each shard's (max, sum of
    exponentials, target logit) per position are gathered, every shard combines them in
    shard order, and the logits are never gathered. With one shard, one fused op."""
    be, tp, shard = st.be, st.part.tp, st.part.shard
    if tp == 1:
        return be.cross_entropy(logits, losses, targets, st.valid, dloss)
    stats = st.s["lstats"].reshape(-1)[:tp * len(losses) * 3].reshape(tp, -1, 3)
    be.classifier_stats(stats[shard], logits, targets, st.v0, st.valid)
    st.comm.all_gather(stats[shard], stats, "tp")
    be.classifier(logits, losses, stats, targets, st.v0, st.valid, dloss)
