"""A deterministic tiny llama-architecture GGUF model, written with the `gguf` package.

Random weights, a synthetic SentencePiece-style vocabulary of 730 tokens and a ChatML chat
template, so llama.cpp serves `/v1/chat/completions` and `/v1/completions` from it. It is a
real model to llama.cpp (about 0.7 MB, two layers, 64 wide) and generates readable word salad
fast: thousands of tokens a second on one CPU thread.

How random weights are made to behave (the "bias channel"): residual dimension 0 holds the
constant 4.0 for every token and nothing writes to it, so after the final RMSNorm it is still
positive, and column 0 of `output.weight` acts as a per-token logit bias. Every token but whole
words and `. , ! ?` gets -1000, so output is words; the end-of-generation tokens get a small
negative bias, so the model **never stops by itself**: a request gets exactly `max_tokens`
tokens back (`finish_reason "length"`) unless it sends `logit_bias {EOS_ID: 100}` (immediate
stop) or a `stop` string. `temperature 0` is deterministic. Different seeds give different
models.

    python -m gpuproxy.testing.tinymodel OUT.gguf [--seed N] [--name NAME] [--no-cache]
    python -m gpuproxy.testing.tinymodel OUT_DIR --hf [--seed N]     (Hugging Face, for vLLM)

The file is the same byte for byte for the same seed and name. It is built once into a cache
directory (`$GPUPROXY_MODEL_CACHE`, else `<tmp>/gpuproxy-tinymodels`) keyed by the content of
this generator, the `gguf` version and the parameters, and copied from there afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

SPACE = "\u2581"  # SentencePiece's word-start marker

# The words the model can say. Each one becomes tokens for all its prefixes (so tokenizing any
# text works) and the whole word is an allowed output token.
WORDS = tuple("""
the of and to in is was that for it with as on be at by this had not are but from or have an
they which one you were her all she there would their we him been has when who will more no if
out so said what up its about into than them can only other new some could time these two may
then do first any my now such like our over man me even most made after also did many before
must through back years where much your way well down should because each just those people how
too little state good very make world still own see men work long get here between both life
being under never day same another know while last might us great old year off come since
against go came right used take three quick brown fox jumps lazy dog model proxy server token
""".split())

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3, 4
EOS_BIAS = -10.0  # logit bias of the end-of-generation tokens: a stop is possible, not likely
FORBIDDEN_BIAS = -1000.0


@dataclass(frozen=True)
class Shape:
    """The model's dimensions (llama hyperparameters)."""

    n_embd: int = 64
    n_layer: int = 2
    n_ff: int = 128
    n_head: int = 2
    context_length: int = 32768  # long generations for tests; the KV cache is what -c asks


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    allowed: list[int]  # ids the model may generate (besides end-of-generation)


def synthetic_vocab() -> Vocab:
    import gguf

    tt = gguf.TokenType
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    allowed: set[int] = set()
    index: dict[str, int] = {}

    def add(text: str, kind: gguf.TokenType, score: float = 0.0, gen: bool = False) -> None:
        if text not in index:
            index[text] = len(tokens)
            tokens.append(text)
            scores.append(score)
            types.append(int(kind))
        if gen:
            allowed.add(index[text])

    for text, kind in [("<unk>", tt.UNKNOWN), ("<s>", tt.CONTROL), ("</s>", tt.CONTROL),
                       ("<|im_start|>", tt.CONTROL), ("<|im_end|>", tt.CONTROL)]:
        add(text, kind)
    for byte in range(256):  # byte fallback: any text tokenizes
        add(f"<0x{byte:02X}>", tt.BYTE)
    add(SPACE, tt.NORMAL, -1.0)
    for code in range(0x21, 0x7F):
        add(chr(code), tt.NORMAL, -1.0, gen=chr(code) in ".,!?")
    for word in WORDS:
        piece = SPACE + word
        for k in range(2, len(piece) + 1):
            add(piece[:k], tt.NORMAL, float(k), gen=k == len(piece))
    assert tokens[EOS_ID] == "</s>" and tokens[IM_END_ID] == "<|im_end|>"
    return Vocab(tokens, scores, types, sorted(allowed))


def weights(*, seed: int, n_vocab: int, allowed: list[int], shape: Shape):
    """The tensors, as (GGUF name, float32 array of shape (out, in)), seeded."""
    import numpy as np

    e, f = shape.n_embd, shape.n_ff
    rng = np.random.default_rng(seed)

    def normal(*dims: int, std: float) -> np.ndarray:
        return (rng.standard_normal(dims) * std).astype(np.float32)

    embedding = normal(n_vocab, e, std=1.0)
    embedding[:, 0] = 4.0  # the bias channel
    yield "token_embd.weight", embedding
    ones = np.ones(e, np.float32)
    for i in range(shape.n_layer):
        p = f"blk.{i}"
        yield f"{p}.attn_norm.weight", ones
        for part in ("attn_q", "attn_k", "attn_v"):
            yield f"{p}.{part}.weight", normal(e, e, std=e ** -0.5)
        out = normal(e, e, std=0.5 * e ** -0.5)
        out[0] = 0.0  # nothing writes to the bias channel
        yield f"{p}.attn_output.weight", out
        yield f"{p}.ffn_norm.weight", ones
        yield f"{p}.ffn_gate.weight", normal(f, e, std=e ** -0.5)
        yield f"{p}.ffn_up.weight", normal(f, e, std=e ** -0.5)
        down = normal(e, f, std=0.5 * f ** -0.5)
        down[0] = 0.0
        yield f"{p}.ffn_down.weight", down
    yield "output_norm.weight", ones
    head = normal(n_vocab, e, std=3 * e ** -0.5)
    head[:, 0] = FORBIDDEN_BIAS
    head[allowed, 0] = 0.0
    head[[EOS_ID, IM_END_ID], 0] = EOS_BIAS
    yield "output.weight", head


def write_model(path: str | os.PathLike[str], *, seed: int = 0, name: str = "tiny",
                shape: Shape = Shape()) -> Path:
    """Write the model to `path` (no cache); returns the path."""
    import gguf

    path = Path(path)
    vocab = synthetic_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head)
    w.add_rope_dimension_count(shape.n_embd // shape.n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab.tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("llama")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_eot_token_id(IM_END_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(CHATML)

    # numpy shapes are (out, in); the writer stores them in ggml order.
    for tensor_name, array in weights(seed=seed, n_vocab=len(vocab.tokens),
                                      allowed=vocab.allowed, shape=shape):
        w.add_tensor(tensor_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


HF_SHAPE = Shape(n_embd=128, n_layer=2, n_ff=256, n_head=2, context_length=2048)
_HF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def write_hf_model(folder: str | os.PathLike[str], *, seed: int = 0,
                   shape: Shape = HF_SHAPE) -> Path:
    """The same kind of model in Hugging Face format, for vLLM (`make test-vllm`).

    Needs torch, transformers and tokenizers (vLLM brings them), not gguf. Word-level
    vocabulary (the words, `. , ! ?`, the special tokens), ChatML template, bfloat16.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    words = list(dict.fromkeys([*WORDS, ".", ",", "!", "?"]))
    tokens = specials + words
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=specials[3:])
    fast.chat_template = CHATML
    config = LlamaConfig(
        vocab_size=len(tokens), hidden_size=shape.n_embd, intermediate_size=shape.n_ff,
        num_hidden_layers=shape.n_layer, num_attention_heads=shape.n_head,
        num_key_value_heads=shape.n_head, max_position_embeddings=shape.context_length,
        rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    state = {}
    for gguf_name, array in weights(seed=seed, n_vocab=len(tokens),
                                    allowed=list(range(len(specials), len(tokens))),
                                    shape=shape):
        parts = gguf_name.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{_HF_NAMES[parts[2]]}.weight"
        else:
            hf = f"{_HF_NAMES[parts[0]]}.weight"
        state[hf] = torch.from_numpy(array)
    model.load_state_dict(state, strict=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def default_cache_dir() -> Path:
    configured = os.environ.get("GPUPROXY_MODEL_CACHE")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "gpuproxy-tinymodels"


def cache_key(*, seed: int, name: str, shape: Shape) -> str:
    """What determines the bytes: this generator's source, the gguf version, the parameters."""
    from importlib.metadata import version

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(f"gguf={version('gguf')};seed={seed};name={name};{asdict(shape)}".encode())
    return digest.hexdigest()[:24]


def ensure_model(path: str | os.PathLike[str], *, seed: int = 0, name: str = "tiny",
                 shape: Shape = Shape(), cache_dir: str | os.PathLike[str] | None = None,
                 use_cache: bool = True) -> Path:
    """Write the model to `path`, from the cache when it holds it (built there first if not)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not use_cache:
        return _write_atomically(path, seed=seed, name=name, shape=shape)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = cache / f"{name}-{cache_key(seed=seed, name=name, shape=shape)}.gguf"
    if not cached.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomically(cached, seed=seed, name=name, shape=shape)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    shutil.copyfile(cached, partial)
    os.replace(partial, path)
    return path


def _write_atomically(path: Path, **params) -> Path:
    """Concurrent writers (parallel test sessions) never expose a half-written file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write_model(partial, **params)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuproxy.testing.tinymodel",
        description="Write a deterministic tiny llama GGUF model (random weights, synthetic "
                    "vocabulary, ChatML template).")
    parser.add_argument("out", help="the .gguf file to write (a folder with --hf)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--name", default="tiny", help="general.name in the file (default tiny)")
    parser.add_argument("--no-cache", action="store_true",
                        help="generate afresh instead of copying from the cache directory")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face model folder instead, for vLLM (needs torch, "
                             "transformers, tokenizers; no cache)")
    args = parser.parse_args(argv)
    if args.hf:
        print(f"wrote {write_hf_model(args.out, seed=args.seed)}")
        return 0
    out = ensure_model(args.out, seed=args.seed, name=args.name, use_cache=not args.no_cache)
    print(f"wrote {out} ({out.stat().st_size} bytes, seed {args.seed}, name {args.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
