"""Weight conversion HF <-> Megatron, single process: bit-identical round trips for every family,
the streaming safetensors reader / writer, the errors a user can cause, and the CLI entry points."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_agentrl.config import ConfigError
from tests.support.tiny_models import FAMILIES, VOCAB, read_safetensors_dir, write_tiny_checkpoint


def _convert_both_ways(src: Path, tmp: Path, tp: int = 1, pp: int = 1, **kw) -> tuple[Path, Path]:
    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf

    mg = convert_hf_to_megatron(src, tmp / "mg", tp=tp, pp=pp, progress=False, **kw)
    back = convert_megatron_to_hf(mg, tmp / "back", progress=False, max_shard_size="60KB")
    return mg, back


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_hf_megatron_hf_bit_identical(family: str, tied: bool, tp: int, pp: int, tmp_path: Path) -> None:
    """HF -> Megatron (TP=2 or PP=2 layout) -> HF gives the very same tensors, names and config;
    tokenizer files travel along; the output is sharded with an index."""
    write_tiny_checkpoint(family, tmp_path / "hf", tied=tied, max_shard_size="50KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # sharded input
    mg, back = _convert_both_ways(tmp_path / "hf", tmp_path, tp, pp)
    orig, got = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(back)
    assert sorted(got) == sorted(orig)
    for k in orig:
        assert got[k].dtype == orig[k].dtype and torch.equal(got[k], orig[k]), k
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(orig) and len(set(index["weight_map"].values())) > 1
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (back / f).read_bytes() == (tmp_path / "hf" / f).read_bytes(), f
    c0 = json.loads((tmp_path / "hf" / "config.json").read_text())
    c1 = json.loads((back / "config.json").read_text())
    assert {k: v for k, v in c1.items() if k != "dtype"} == {k: v for k, v in c0.items() if k != "dtype"}
    info = json.loads((mg / "agentrl_checkpoint.json").read_text())
    assert (info["model_type"], info["tp"], info["pp"]) == (family, tp, pp)
    assert info["padded_vocab_size"] == {1: 384, 2: 512}[tp]


def test_vocab_padding_both_ways(tmp_path: Path) -> None:
    """The stored vocab tensors are padded to a multiple of 128 * tp with zero rows (as a TP=2
    megatron model saves them); converting back strips the padding."""
    from megatron_agentrl.convert.checkpoint import DistCheckpointReader

    write_tiny_checkpoint("qwen2", tmp_path / "hf", tied=False)
    mg, back = _convert_both_ways(tmp_path / "hf", tmp_path, tp=2)
    r = DistCheckpointReader(mg)
    assert r.shape("embedding.word_embeddings.weight") == (512, 64)
    assert r.shape("output_layer.weight") == (512, 64)
    assert r.shape("decoder.layers.self_attention.linear_qkv.weight") == (2, (4 + 2 * 2) * 16, 64)
    emb = r.read({"e": ("embedding.word_embeddings.weight", (0, 0), (512, 64))})["e"]
    orig = read_safetensors_dir(tmp_path / "hf")
    assert torch.equal(emb[:VOCAB], orig["model.embed_tokens.weight"]) and not emb[VOCAB:].any()
    assert read_safetensors_dir(back)["lm_head.weight"].shape == (VOCAB, 64)


def test_dtype_conversion_bf16(tmp_path: Path) -> None:
    """--dtype bfloat16 stores bf16; converting back gives the bf16 cast of the original, exactly,
    and a bf16 HF checkpoint round-trips bit-identically."""
    from megatron_agentrl.convert.checkpoint import DistCheckpointReader

    write_tiny_checkpoint("glm4", tmp_path / "hf")
    mg, back = _convert_both_ways(tmp_path / "hf", tmp_path, tp=2, dtype="bfloat16")
    assert DistCheckpointReader(mg).dtype("decoder.layers.mlp.linear_fc1.weight") == torch.bfloat16
    orig, got = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(back)
    assert all(torch.equal(got[k], orig[k].to(torch.bfloat16)) for k in orig)
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"
    (tmp_path / "b").mkdir()
    _, back2 = _convert_both_ways(back, tmp_path / "b", tp=1)
    got2 = read_safetensors_dir(back2)
    assert all(torch.equal(got2[k], got[k]) for k in got)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_back_loads_in_transformers(family: str, tmp_path: Path) -> None:
    """The HF directory written by megatron-to-hf loads with from_pretrained and gives the same logits."""
    from transformers import AutoModelForCausalLM

    model = write_tiny_checkpoint(family, tmp_path / "hf")
    _, back = _convert_both_ways(tmp_path / "hf", tmp_path, tp=2)
    loaded = AutoModelForCausalLM.from_pretrained(str(back)).eval()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


# ------------------------------------------------------------------------- streaming I/O
def test_safetensors_reader_and_shard_writer(tmp_path: Path) -> None:
    """The streaming writer splits by size, writes an index safetensors itself can read; the
    reader reads whole tensors and row ranges; out-of-order or wrong tensors are refused."""
    from safetensors import safe_open

    from megatron_agentrl.convert.safetensors_io import SafetensorsReader, SafetensorsShardWriter, parse_size

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(10, 4, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3), "d": torch.randn(40, 4, generator=g)}
    plan = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    w = SafetensorsShardWriter(tmp_path, plan, max_shard_bytes=200)
    with pytest.raises(ValueError, match="expected tensor 'a' next"):
        w.write("b", tensors["b"])
    with pytest.raises(ValueError, match="planned"):
        w.write("a", tensors["a"].double())
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    # a+b | c | d
    assert list(index["weight_map"].values()) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 1, 2, 3)]
    for k, f in index["weight_map"].items():
        with safe_open(str(tmp_path / f), "pt") as fh:
            assert torch.equal(fh.get_tensor(k), tensors[k])
    r = SafetensorsReader(tmp_path)
    assert all(torch.equal(r.read(k), v) for k, v in tensors.items())
    assert torch.equal(r.read("d", rows=(5, 9)), tensors["d"][5:9])
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(7) == 7
    with pytest.raises(ConfigError, match="byte count"):
        parse_size("lots")


# ---------------------------------------------------------------------------- user errors
def test_error_unknown_architecture(tmp_path: Path) -> None:
    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron

    write_tiny_checkpoint("qwen2", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"unknown architecture \['GPTNeoXForCausalLM'\].*Qwen2ForCausalLM"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mg", progress=False)


def test_error_tp_does_not_divide_heads(tmp_path: Path) -> None:
    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron

    write_tiny_checkpoint("llama", tmp_path / "hf")
    with pytest.raises(ConfigError,
                       match=r"tp=3 does not divide num_attention_heads=4, num_key_value_heads=2.*\[1, 2\]"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=3, progress=False)
    with pytest.raises(ConfigError, match="pp=3 does not divide num_hidden_layers=2"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mg", pp=3, progress=False)
    assert not (tmp_path / "mg").exists()  # nothing written


def test_error_missing_shard(tmp_path: Path) -> None:
    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf

    write_tiny_checkpoint("qwen2", tmp_path / "hf", max_shard_size="50KB")
    mg = convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mg", progress=False)
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard.name}.*missing"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mg2", progress=False)
    next(mg.glob("*.distcp")).unlink()
    with pytest.raises(FileNotFoundError, match=r"__0_0\.distcp.*missing"):
        convert_megatron_to_hf(mg, tmp_path / "back", progress=False)
    with pytest.raises(ConfigError, match="is a megatron distributed checkpoint.*megatron-to-hf"):
        convert_hf_to_megatron(mg, tmp_path / "mg3", progress=False)
    (tmp_path / "cfg_only").mkdir()
    (tmp_path / "cfg_only" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        convert_hf_to_megatron(tmp_path / "cfg_only", tmp_path / "mg3", progress=False)


def test_error_checkpoint_of_another_family(tmp_path: Path) -> None:
    """Weights of one family under another's config, and a megatron checkpoint converted with
    another family's config, fail with a message that says so."""
    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf

    write_tiny_checkpoint("glm4", tmp_path / "glm")
    write_tiny_checkpoint("llama", tmp_path / "llama")
    mg = convert_hf_to_megatron(tmp_path / "glm", tmp_path / "mg", progress=False)
    # HF: GLM-4 weights, Llama config
    (tmp_path / "mixed").mkdir()
    for f in (tmp_path / "glm").iterdir():
        (tmp_path / "mixed" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "mixed" / "config.json").write_text((tmp_path / "llama" / "config.json").read_text())
    with pytest.raises(ConfigError, match="unexpected.*post_self_attn_layernorm.*another family"):
        convert_hf_to_megatron(tmp_path / "mixed", tmp_path / "mg2", progress=False)
    # Megatron: a GLM-4 checkpoint with a Llama config
    with pytest.raises(ConfigError, match="is a glm4 .*checkpoint, but the model config is llama"):
        convert_megatron_to_hf(mg, tmp_path / "back", hf_config=tmp_path / "llama", progress=False)
    (mg / "agentrl_checkpoint.json").unlink()  # as a checkpoint saved by plain megatron code
    with pytest.raises(ConfigError, match="does not hold a llama model.*another family"):
        convert_megatron_to_hf(mg, tmp_path / "back", hf_config=tmp_path / "llama" / "config.json", progress=False)
    with pytest.raises(ConfigError, match="not a megatron-core distributed checkpoint.*hf-to-megatron"):
        convert_megatron_to_hf(tmp_path / "glm", tmp_path / "back", progress=False)


def test_error_non_empty_output(tmp_path: Path) -> None:
    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron

    write_tiny_checkpoint("qwen2", tmp_path / "hf")
    convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mg", progress=False)
    with pytest.raises(ConfigError, match="not empty"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mg", progress=False)
    convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=2, progress=False, overwrite=True)


# ----------------------------------------------------------------------------------- CLI
def test_cli_agentrl_convert_and_tools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``agentrl convert ...`` and the tools/ entry points convert both ways; a bad TP exits 2
    with the message on stderr."""
    from megatron_agentrl.cli import main
    from megatron_agentrl.convert.cli import main_hf_to_megatron, main_megatron_to_hf

    write_tiny_checkpoint("glm4", tmp_path / "hf")
    assert main(["convert", "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--out-dir", str(tmp_path / "mg"),
                 "--tp", "2", "--pp", "2", "--no-progress"]) == 0
    assert main(["convert", "megatron-to-hf", "--megatron-dir", str(tmp_path / "mg"), "--out-dir",
                 str(tmp_path / "back"), "--dtype", "bfloat16", "--no-progress"]) == 0
    orig, got = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(tmp_path / "back")
    assert all(torch.equal(got[k], orig[k].bfloat16()) for k in orig)
    assert main_hf_to_megatron(["--hf-dir", str(tmp_path / "hf"), "--out-dir", str(tmp_path / "mg2"),
                                "--no-progress"]) == 0
    assert main_megatron_to_hf(["--megatron-dir", str(tmp_path / "mg2"), "--out-dir", str(tmp_path / "back2"),
                                "--no-progress"]) == 0
    assert all(torch.equal(v, orig[k]) for k, v in read_safetensors_dir(tmp_path / "back2").items())
    capsys.readouterr()
    assert main(["convert", "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--out-dir", str(tmp_path / "x"),
                 "--tp", "8"]) == 2
    assert "tp=8 does not divide num_attention_heads=4" in capsys.readouterr().err
