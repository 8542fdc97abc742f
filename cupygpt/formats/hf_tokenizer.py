"""transformers' GPT-2 tokenizer files (vocab.json, merges.txt) from llm.c's tokenizer file.

llm.c's file holds each token's bytes in id order, and GPT-2's BPE ranks are its ids, so the
merges follow from it: a token is the merge of the two pieces that BPE, allowed only the
tokens ranked below it, leaves of its bytes. Both files spell bytes as GPT-2's printable
characters (bytes_to_unicode), which is what transformers' byte-level BPE reads.
"""
import json
import os


def bytes_to_unicode():
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def merges(tokens, eot):
    """GPT-2's merges, in rank order, as pairs of byte strings."""
    rank = {t: i for i, t in enumerate(tokens) if i != eot}
    out = []
    for i, tok in enumerate(tokens):
        if i == eot or len(tok) < 2:
            continue
        parts = [tok[j:j + 1] for j in range(len(tok))]
        while len(parts) > 2:  # apply the best merge ranked below this token
            best = min(range(len(parts) - 1),
                       key=lambda j: rank.get(parts[j] + parts[j + 1], len(tokens)))
            if rank.get(parts[best] + parts[best + 1], i) >= i:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2:  # (otherwise a token BPE never makes: it has no merge)
            out.append(tuple(parts))
    return out


def write_tokenizer(path, tok, max_length):
    """vocab.json, merges.txt and tokenizer_config.json of the llm.c tokenizer tok in the
    directory path; returns the files' names."""
    char = bytes_to_unicode()
    spell = lambda b: "".join(char[x] for x in b)  # noqa: E731
    vocab = {spell(t): i for i, t in enumerate(tok.tokens) if i != tok.eot}
    vocab["<|endoftext|>"] = tok.eot
    with open(os.path.join(path, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(path, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        f.writelines(f"{spell(a)} {spell(b)}\n" for a, b in merges(tok.tokens, tok.eot))
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": max_length,
              "add_prefix_space": False, **{k: "<|endoftext|>" for k in
                                            ("bos_token", "eos_token", "unk_token")}}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return ["vocab.json", "merges.txt", "tokenizer_config.json"]
