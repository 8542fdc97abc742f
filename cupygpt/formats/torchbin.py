"""PyTorch's zip checkpoint (torch.save of a state dict: transformers' legacy
pytorch_model.bin) read without torch.

The pickle inside may name only what a plain state dict of tensors needs (a dict, tensors
rebuilt from storages); anything else is refused rather than run, so reading a file cannot
execute its code. A tensor is described from the pickle alone; its bytes are read on demand
from the zip member holding its storage.
"""
import collections
import pickle
import zipfile

import numpy as np

from .. import CupyGPTError

STORAGES = {"FloatStorage": ("F32", "<f4"), "HalfStorage": ("F16", "<f2"),
            "DoubleStorage": ("F64", "<f8"), "BFloat16Storage": ("BF16", "<u2")}


class Tensor(collections.namedtuple("Tensor", "key dtype offset shape stride")):
    """Where a tensor lies: storage key, (name, NumPy dtype), element offset, shape, strides."""


def rebuild(storage, offset, shape, stride, *_):
    return Tensor(storage[0], storage[1], offset, tuple(shape), tuple(stride))


class Unpickler(pickle.Unpickler):
    ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
               ("torch._utils", "_rebuild_tensor_v2"): rebuild}

    def find_class(self, module, name):
        if module == "torch" and name in STORAGES:
            return STORAGES[name]
        if (module, name) not in self.ALLOWED:
            raise CupyGPTError(f"its pickle asks for {module}.{name}: not a plain state dict "
                               f"of tensors, which is all cupygpt reads without torch")
        return self.ALLOWED[(module, name)]

    def persistent_load(self, pid):  # ("storage", storage type, key, location, numel)
        return pid[2], pid[1]


def torch_weights(file):
    """({name: (shape, dtype)}, read(name) -> array) of a torch.save'd state dict."""
    try:
        z = zipfile.ZipFile(file)
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        state = Unpickler(z.open(pkl)).load()
    except CupyGPTError as e:
        raise CupyGPTError(f"{file}: {e}") from None
    except (OSError, StopIteration, zipfile.BadZipFile, pickle.UnpicklingError) as e:
        raise CupyGPTError(f"{file}: not PyTorch's zip checkpoint ({e or 'no data.pkl'}); "
                           f"a file saved before torch 1.6 needs torch to convert") from None
    if not isinstance(state, dict) or not all(isinstance(t, Tensor) for t in state.values()):
        raise CupyGPTError(f"{file}: holds no state dict of tensors")
    root = pkl[:-len("data.pkl")]

    def read(name):
        t = state[name]
        item = np.dtype(t.dtype[1]).itemsize
        buf = np.frombuffer(z.read(f"{root}data/{t.key}"), t.dtype[1])
        last = t.offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride))
        # (torch has no negative strides: one here reached memory before the storage)
        if min(t.shape, default=1) > 0 and (min(t.stride, default=0) < 0 or t.offset < 0
                                            or not 0 <= last < buf.size):
            raise CupyGPTError(f"{file}: tensor {name} lies outside its storage")
        view = np.lib.stride_tricks.as_strided(buf[t.offset:], t.shape,
                                               [s * item for s in t.stride])
        return np.array(view)
    return {k: (t.shape, t.dtype[0]) for k, t in state.items()}, read
