from enum import IntEnum


class SignalOp(IntEnum):  # NVSHMEM_SIGNAL_SET / NVSHMEM_SIGNAL_ADD
    SIGNAL_SET = 0
    SIGNAL_ADD = 5
