"""One msrun worker of `mindloom check-env --nproc N`: an all-reduce of ones across N ranks."""

from __future__ import annotations

import sys


def main() -> int:
    import mindspore as ms
    import numpy as np
    from mindspore import ops
    from mindspore.communication import GlobalComm, get_group_size, get_rank, init

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init()
    rank, size = get_rank(), get_group_size()
    expected = int(sys.argv[1]) if len(sys.argv) > 1 else size
    x = ms.Tensor(np.full((4,), rank + 1, np.float32))
    got = ops.AllReduce(ops.ReduceOp.SUM, group=GlobalComm.WORLD_COMM_GROUP)(x).asnumpy()
    want = size * (size + 1) / 2
    ok = size == expected and bool(np.all(got == want))
    print(
        f"allreduce rank {rank}/{size} sum={got[0]:.0f} expected={want:.0f} {'ok' if ok else 'WRONG'}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
