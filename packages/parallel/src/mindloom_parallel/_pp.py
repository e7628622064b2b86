"""Pipeline parallel: stage assignment, the stage model and the 1F1B schedule.

A stage is the model itself with the other stages' parts removed (``pipeline_stage``):
``mindloom_model.Llama.construct`` embeds only token ids and stops before the final norm
when that is gone, so every layout runs the one forward there is.

The schedule is a plain list of actions per stage (Megatron's non-interleaved 1F1B), so
it can be checked without processes: ``simulate`` runs every stage's list against its
neighbours with blocking rendezvous semantics and proves each communication has a
partner of the same kind at the same point (no deadlock, no shape mix-up).

Communication actions between stage s and s+1 pair up as
``send_fwd <-> recv_fwd``, ``send_fwd_recv_bwd <-> send_bwd_recv_fwd`` and
``recv_bwd <-> send_bwd``; each is one exchange in the two-rank group of the pair.
"""

from __future__ import annotations

__all__ = ["stage_layers", "pipeline_stage", "one_f_one_b", "simulate"]


def stage_layers(num_layers: int, pp: int, stage: int) -> list[int]:
    """Contiguous, equal blocks of layers (validate() guarantees divisibility)."""
    k = num_layers // pp
    return list(range(stage * k, (stage + 1) * k))


def pipeline_stage(model, layer_ids: list[int], first: bool, last: bool):
    """Cut ``model`` (a ``mindloom_model.Llama``) in place down to one pipeline stage; returns it.

    Kept: the layers ``layer_ids`` (under their global names, ``layers.3...``), the
    embedding on the first stage (and on the last when the head is tied to it), the final
    norm and head on the last. The stage then maps token ids (first) or hidden states
    [B, S, D] to hidden states, or (last) to logits. The whole range on one stage leaves
    the model untouched.
    """
    from collections import OrderedDict

    from mindspore import nn

    n = len(model.layers)
    if first and last and list(layer_ids) == list(range(n)):
        return model
    if not first and not (last and model.tie_embeddings):
        model.embed = None
        model.embed_dropout = None
    if not last:
        model.norm = None
        if not model.tie_embeddings:
            model.lm_head = None
    kept = OrderedDict((str(i), model.layers[i]) for i in layer_ids)
    model.layers = nn.SequentialCell(kept)
    for name, p in model.parameters_and_names():
        p.name = name  # global module paths, unique for graph mode
    return model


def one_f_one_b(stage: int, num_stages: int, num_micro: int) -> list[tuple]:
    """Actions for ``stage``: ("fwd", i), ("bwd", i) and the communication actions.

    A communication action the stage has no partner for (the first stage receives no
    activations, the last sends none) is left out.
    """
    first, last = stage == 0, stage == num_stages - 1
    warmup = min(num_stages - stage - 1, num_micro)
    remaining = num_micro - warmup
    acts: list[tuple] = []

    def add(kind: str) -> None:
        if (first and kind in _UP) or (last and kind in _DOWN):
            return
        acts.append((kind,))

    for i in range(warmup):
        add("recv_fwd")
        acts.append(("fwd", i))
        add("send_fwd")
    if remaining > 0:
        add("recv_fwd")
    for i in range(remaining):
        acts.append(("fwd", warmup + i))
        add("send_fwd_recv_bwd")
        acts.append(("bwd", i))
        if i == remaining - 1:
            add("send_bwd")
        else:
            add("send_bwd_recv_fwd")
    for i in range(warmup):
        add("recv_bwd")
        acts.append(("bwd", remaining + i))
        add("send_bwd")
    return acts


_PARTNER = {
    "send_fwd": "recv_fwd",
    "send_fwd_recv_bwd": "send_bwd_recv_fwd",
    "recv_bwd": "send_bwd",
}
_DOWN = set(_PARTNER)  # actions towards the next stage
_UP = set(_PARTNER.values())  # actions towards the previous stage


def simulate(num_stages: int, num_micro: int) -> list[list[tuple]]:
    """Run every stage's schedule with blocking pairwise rendezvous; return the per-stage
    order of completed actions, or raise RuntimeError on a deadlock or a kind mismatch.
    Also checks data flow: a stage's fwd i needs activation i, its bwd i the gradient i.
    """
    scheds = [one_f_one_b(s, num_stages, num_micro) for s in range(num_stages)]
    pos = [0] * num_stages
    done: list[list[tuple]] = [[] for _ in range(num_stages)]
    fwd_out: list[list[int]] = [[] for _ in range(num_stages)]  # fwd ids sent downstream
    bwd_out: list[list[int]] = [[] for _ in range(num_stages)]  # bwd ids sent upstream
    fwd_in: list[list[int]] = [[] for _ in range(num_stages)]
    bwd_in: list[list[int]] = [[] for _ in range(num_stages)]
    fwd_done: list[list[int]] = [[] for _ in range(num_stages)]
    bwd_done: list[list[int]] = [[] for _ in range(num_stages)]
    while any(pos[s] < len(scheds[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if pos[s] >= len(scheds[s]):
                continue
            act = scheds[s][pos[s]]
            kind = act[0]
            if kind == "fwd":
                i = act[1]
                if s > 0 and i not in fwd_in[s]:
                    raise RuntimeError(f"stage {s} runs fwd {i} before receiving its input")
                fwd_done[s].append(i)
            elif kind == "bwd":
                i = act[1]
                if i not in fwd_done[s]:
                    raise RuntimeError(f"stage {s} runs bwd {i} before fwd {i}")
                if s < num_stages - 1 and i not in bwd_in[s]:
                    raise RuntimeError(f"stage {s} runs bwd {i} before receiving its gradient")
                bwd_done[s].append(i)
            elif kind in _DOWN:
                peer = s + 1
                if pos[peer] >= len(scheds[peer]) or scheds[peer][pos[peer]][0] not in _UP:
                    continue  # blocked until the peer reaches its matching action
                pk = scheds[peer][pos[peer]][0]
                if pk != _PARTNER[kind]:
                    raise RuntimeError(f"stage {s} {kind} meets stage {peer} {pk}")
                _transfer(s, peer, kind, fwd_done, bwd_done, fwd_out, bwd_out, fwd_in, bwd_in)
                done[peer].append(scheds[peer][pos[peer]])
                pos[peer] += 1
            else:  # an upward action completes only with its partner's downward one
                continue
            done[s].append(act)
            pos[s] += 1
            progressed = True
        if not progressed:
            state = {s: scheds[s][pos[s]] for s in range(num_stages) if pos[s] < len(scheds[s])}
            raise RuntimeError(f"deadlock: waiting actions {state}")
    for s in range(num_stages):
        if sorted(fwd_done[s]) != list(range(num_micro)) or sorted(bwd_done[s]) != list(
            range(num_micro)
        ):
            raise RuntimeError(f"stage {s} did not run every micro-batch once")
    return done


def _transfer(s, peer, kind, fwd_done, bwd_done, fwd_out, bwd_out, fwd_in, bwd_in):
    if kind in ("send_fwd", "send_fwd_recv_bwd"):
        i = next(j for j in fwd_done[s] if j not in fwd_out[s])
        fwd_out[s].append(i)
        fwd_in[peer].append(i)
    if kind in ("recv_bwd", "send_fwd_recv_bwd"):
        i = next(j for j in bwd_done[peer] if j not in bwd_out[peer])
        bwd_out[peer].append(i)
        bwd_in[s].append(i)
