"""Hugging Face transformers' GPT-2 directories (config.json + model.safetensors) as llm.c's
model: the shape from config.json, the parameters in llm.c's flat order, and back.

transformers keeps each linear weight as a Conv1D, (in, out): llm.c's (out, in) transposed.
Its vocab is V rows; llm.c pads wte to Vp with zero rows, which only llm.c's files carry
(config.json keeps Vp under its own key, so llm.c -> HF -> llm.c is byte-identical).
Reading checks config.json and the safetensors header (names, shapes, dtypes) before a
parameter is read: that is what validate() calls.
"""
import glob
import os
import re

import numpy as np
from safetensors import safe_open

from .. import CupyGPTError
from ..model.layout import param_layout
from ..model.shape import GPT2_V, GPT2Config, padded_vocab
from ..paths import CHECKPOINT, loads, read_bounded
from .torchbin import torch_weights

CONFIG, WEIGHTS, TORCH_WEIGHTS = "config.json", "model.safetensors", "pytorch_model.bin"
VP_KEY = "cupygpt_padded_vocab_size"
ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
# config.json fields whose other values are other math than llm.c's GPT-2 (absent: the
# default, which is GPT-2's); gelu_pytorch_tanh is the same tanh GELU as gelu_new
SAME_MATH = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"),
             "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
             "tie_word_embeddings": (True,), "add_cross_attention": (False,),
             "layer_norm_epsilon": (1e-5,)}
# transformers' tensor -> (llm.c's, transposed); per layer under h.N.
LAYER = {"ln_1.weight": ("ln1w", False), "ln_1.bias": ("ln1b", False),
         "attn.c_attn.weight": ("qkvw", True), "attn.c_attn.bias": ("qkvb", False),
         "attn.c_proj.weight": ("attprojw", True), "attn.c_proj.bias": ("attprojb", False),
         "ln_2.weight": ("ln2w", False), "ln_2.bias": ("ln2b", False),
         "mlp.c_fc.weight": ("fcw", True), "mlp.c_fc.bias": ("fcb", False),
         "mlp.c_proj.weight": ("fcprojw", True), "mlp.c_proj.bias": ("fcprojb", False)}
WHOLE = {"wte.weight": ("wte", False), "wpe.weight": ("wpe", False),
         "ln_f.weight": ("lnfw", False), "ln_f.bias": ("lnfb", False)}
BLOCK = re.compile(r"h\.(\d+)\.")  # a block's tensors: h.INDEX.attn.c_attn.weight, ...
PREFIX = "transformer."  # GPT2LMHeadModel's; GPT2Model (and the hub's gpt2) save without it
BUFFERS = (".attn.bias", ".attn.masked_bias")  # older saves' causal masks, not parameters


def hf_names(shape):
    """{transformers' name (no prefix): (llm.c name, layer or None, transposed, dims)}."""
    shapes = dict(zip(param_layout(shape).names, param_layout(shape).shapes))
    out = {}
    for name, (ours, t) in WHOLE.items():
        dims = (shape.V, shape.C) if ours == "wte" else shapes[ours]
        out[name] = (ours, None, False, dims)
    for layer in range(shape.L):
        for name, (ours, t) in LAYER.items():
            dims = shapes[ours][1:]
            out[f"h.{layer}.{name}"] = (ours, layer, t, dims[::-1] if t else dims)
    return out


def read_config(path):
    """The GPT2Config of a transformers GPT-2 directory, after refusing what is not
    llm.c's GPT-2 (one line naming the field)."""
    file = os.path.join(path, CONFIG)
    try:
        c = loads(read_bounded(file, CONFIG, 1 << 20))
    except FileNotFoundError:
        inside = os.path.join(path, "model.bin")  # (a run's -o, or one of its checkpoints)
        if os.path.isfile(inside):
            raise CupyGPTError(f"{path}: a directory (a run's output or a checkpoint?); give "
                               f"the model file in it, {inside}") from None
        saved = sorted(glob.glob(os.path.join(glob.escape(path), "ckpt_[0-9]*", "model.bin")))
        saved = [f for f in saved if CHECKPOINT.match(os.path.basename(os.path.dirname(f)))]
        if saved:  # (a run under way, or one stopped before its end wrote model.bin)
            raise CupyGPTError(f"{path}: a run's output without its model.bin yet (the run "
                               f"is under way, or stopped early); its newest checkpoint's "
                               f"model is {saved[-1]}") from None
        raise CupyGPTError(f"{path}: a directory but no {CONFIG} in it; a model is an llm.c "
                           f".bin file or a transformers GPT-2 directory") from None
    except (OSError, ValueError) as e:
        raise CupyGPTError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(c, dict):
        raise CupyGPTError(f"{file}: not a JSON object; is this transformers' config.json?")
    odd = [k for k in ("n_embd", "n_positions", "vocab_size", "n_layer", "n_head", VP_KEY)
           if k in c and type(c[k]) is not int]  # (12.0 or true is no layer count)
    if odd:
        raise CupyGPTError(f"{file}: {odd[0]} {c[odd[0]]!r} is not a whole number")
    if c.get("model_type") != "gpt2":
        raise CupyGPTError(f"{file}: model_type {c.get('model_type')!r} is not GPT-2's "
                           f"('gpt2'); only GPT-2 models are read")
    arch = [a for a in c.get("architectures") or [] if a not in ARCHITECTURES]
    if arch:
        raise CupyGPTError(f"{file}: architectures {arch[0]} is not "
                           f"{' or '.join(ARCHITECTURES)}")
    for key, allowed in SAME_MATH.items():
        if key in c and c[key] not in allowed:
            raise CupyGPTError(f"{file}: {key} {c[key]!r} is not GPT-2's ({allowed[0]!r}), "
                               f"which llm.c's model computes; this model cannot be converted")
    C, maxT = c.get("n_embd"), c.get("n_positions")
    for key, want in (("n_inner", 4 * C if isinstance(C, int) else C), ("n_ctx", maxT)):
        if c.get(key) not in (None, want):
            raise CupyGPTError(f"{file}: {key} {c[key]!r} differs from GPT-2's ({want}: "
                               f"{'4 x n_embd' if key == 'n_inner' else 'n_positions'})")
    V = c.get("vocab_size")
    if VP_KEY in c and isinstance(V, int) and not V <= c[VP_KEY] < V + 1024:
        raise CupyGPTError(f"{file}: {VP_KEY} {c[VP_KEY]} is not vocab_size {V} padded (llm.c "
                           f"pads to a multiple of 128: {padded_vocab(V)})")
    try:
        return GPT2Config(maxT=maxT, V=V, Vp=c.get(VP_KEY, padded_vocab(V)),
                          L=c.get("n_layer"), NH=c.get("n_head"), C=C)
    except (CupyGPTError, TypeError) as e:
        raise CupyGPTError(f"{file}: not a valid GPT-2 shape ({e})") from None


def weights_file(path):
    for name in (WEIGHTS, TORCH_WEIGHTS):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    sharded = os.path.isfile(os.path.join(path, WEIGHTS + ".index.json"))
    raise CupyGPTError(f"{path}: no {WEIGHTS} (nor a legacy {TORCH_WEIGHTS}) beside its "
                       f"{CONFIG}; " + ("a sharded checkpoint is not read: save it with "
                                        "save_pretrained(DIR, max_shard_size='10GB')" if sharded
                                        else "save the model with save_pretrained"))


def open_weights(file):
    """({name: (shape, dtype: F32, F16, ...)} from the file's header, read(name) -> array)."""
    if file.endswith(TORCH_WEIGHTS):
        return torch_weights(file)
    try:
        f = safe_open(file, "np")
        index = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                 for k in f.keys()}
    except Exception as e:  # safetensors raises its own types for a damaged header
        raise CupyGPTError(f"{file}: not a readable safetensors file ({e})") from None
    return index, f.get_tensor


def tensor_map(file, index, shape):
    """{name in the file: transformers' name}, after checking every tensor GPT-2 needs is
    there in its shape and a dtype NumPy reads, and nothing else is (a buffer aside)."""
    want, found = hf_names(shape), {}
    layers = {int(m.group(1)) for m in map(BLOCK.match, (k.removeprefix(PREFIX) for k in index))
              if m}
    if layers and len(layers) != shape.L:  # (else a tensor is blamed for the config's count)
        raise CupyGPTError(f"{os.path.join(os.path.dirname(file), CONFIG)}: n_layer is "
                           f"{shape.L}, but {os.path.basename(file)} holds {len(layers)} "
                           f"layers' tensors; the config is not its weights'")
    for key, (dims, dtype) in index.items():
        name = key.removeprefix(PREFIX)
        if name.endswith(BUFFERS):
            continue
        if name not in want and name != "lm_head.weight":
            raise CupyGPTError(f"{file}: tensor {key} is not GPT-2's (another architecture, "
                               f"or a model with other parts)")
        expect = (shape.V, shape.C) if name == "lm_head.weight" else want[name][3]
        if tuple(dims) != tuple(expect):
            raise CupyGPTError(f"{file}: tensor {key} has shape {tuple(dims)}; GPT-2 with "
                               f"this config.json has {tuple(expect)}")
        if dtype not in ("F32", "F16", "F64"):
            raise CupyGPTError(f"{file}: tensor {key} is {dtype}, which NumPy cannot read; "
                               f"save the model in float32 or float16")
        found[key] = name
    missing = sorted(set(want) - set(found.values()), key=list(want).index)
    if missing:
        raise CupyGPTError(f"{file}: tensor {missing[0]} is missing ({len(missing)} of "
                           f"GPT-2's {len(want)} are); a model without biases or with "
                           f"other names is not GPT-2")
    return found


def model_shape(path):
    """The shape of a transformers GPT-2 directory, its tensors checked against it (headers
    only: nothing is read)."""
    shape = read_config(path)
    file = weights_file(path)
    tensor_map(file, open_weights(file)[0], shape)
    return shape


def read_model(path, out=None):
    """(config, fp32 parameters in llm.c's order, rows V..Vp-1 of wte zero)."""
    shape = read_config(path)
    file = weights_file(path)
    index, read = open_weights(file)
    names, where = tensor_map(file, index, shape), hf_names(shape)
    params = np.zeros(param_layout(shape).size, np.float32) if out is None else out
    params[...] = 0
    views = param_layout(shape).views(params)
    for key, name in names.items():
        if name == "lm_head.weight":
            continue
        a, (ours, layer, t, _) = read(key), where[name]
        dst = views[ours] if layer is None else views[ours][layer]
        a = a.T if t else a
        dst[:a.shape[0]] = a  # wte: its V rows of Vp
    head = next((k for k, n in names.items() if n == "lm_head.weight"), None)
    if head and not np.array_equal(read(head), views["wte"][:shape.V]):
        raise CupyGPTError(f"{file}: lm_head.weight differs from wte.weight; llm.c's GPT-2 "
                           f"ties them (an untied head cannot be converted)")
    return shape, params


def hf_config(shape):
    """config.json of the model: transformers' GPT-2 with llm.c's shape."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": shape.V, "n_positions": shape.maxT, "n_embd": shape.C,
            "n_layer": shape.L, "n_head": shape.NH, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
            "dtype": "float32", VP_KEY: shape.Vp,
            # GPT-2's <|endoftext|> starts and ends a text; another vocab's is unknown
            **({"bos_token_id": GPT2_V - 1, "eos_token_id": GPT2_V - 1} if shape.V == GPT2_V
               else {})}


def hf_tensors(shape, params):
    """{transformers' name: fp32 array} of the flat llm.c parameters (wte's padding
    dropped)."""
    views = param_layout(shape).views(np.asarray(params, np.float32))
    out = {}
    for name, (ours, layer, t, dims) in hf_names(shape).items():
        a = views[ours] if layer is None else views[ours][layer]
        out[PREFIX + name] = np.ascontiguousarray(a.T if t else a[:dims[0]])
    return out
