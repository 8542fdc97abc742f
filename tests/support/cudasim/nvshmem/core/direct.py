from enum import IntEnum


class SignalOp(IntEnum):  # NVSHMEM_SIGNAL_SET / NVSHMEM_SIGNAL_ADD
    SIGNAL_SET = 9
    SIGNAL_ADD = 10
