"""Weight versions as LoRA adapters on SGLang: the contract read from the 0.5.23 wheel (request classes, flags, the
names and shapes its LoRA loader expects, its TP slicing), and our client against the stand-in that follows it."""
from __future__ import annotations

import ast
import asyncio
import copy
import types
import zipfile

import httpx
import pytest
import torch

from rollout_sglang.engines.adapter import Adapter
from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import AdapterEngine, EngineUnavailable, SamplingParams
from rollout_sglang.engines.sglang_client import ADMIN_ENDPOINTS, SGLangEngine, SGLangError
from rollout_sglang.engines.sglang_options import SGLANG_LORA_TARGETS, SGLangClientOptions, SGLangLaunchOptions
from rollout_sglang.testing.sglang_contract import ContractError, load_contract
from rollout_sglang.testing.sglang_standin import StandInServer
from rollout_sglang.testing.standin_lora import Geometry, LoraRefused, normalize_weights
from rollout_sglang.testing.standin_options import StandInOptions
from tests.support.peft_adapters import as_adapter, random_peft
from tests.support.tiny_models import tiny_qwen2_config

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(enable_lora=True, max_lora_rank=4, lora_target_modules=tuple(ALL), max_loras_per_batch=4,
            max_loaded_loras=4)


# ------------------------------------------------------------------------------------------- helpers
def _adapter(base: torch.nn.Module, version: int, seed: int, targets: list[str], rank: int = 4) -> Adapter:
    """PEFT's LoRA on ``base`` with random A and B, as an :class:`Adapter`."""
    return as_adapter(random_peft(base, seed, targets, rank, 2.0 * rank), version)


@pytest.fixture(scope="module")
def base():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config()).eval()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Versions 3 and 5 saved in PEFT's format (the second on attention only, rank 2), and one of rank 8."""
    root = tmp_path_factory.mktemp("adapters")
    three = _adapter(base, 3, 1, ALL).save(root / "v3")
    five = _adapter(base, 5, 2, ["q_proj", "k_proj", "v_proj", "o_proj"], rank=2).save(root / "v5")
    wide = _adapter(base, 9, 3, ALL, rank=8).save(root / "v9")
    return three, five, wide


class Served:
    """A stand-in on a copy of ``base`` and our client of it."""

    def __init__(self, base, **options) -> None:
        self.server = StandInServer(LocalEngine(copy.deepcopy(base), seed=0), StandInOptions(**options))
        self.server.start()
        self.client = SGLangEngine(self.server.url, SGLangClientOptions(request_timeout_s=60, control_timeout_s=30,
                                                                        update_timeout_s=30))

    def __enter__(self) -> "Served":
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()


def _wheel_source(wheel, path: str) -> ast.Module:
    with zipfile.ZipFile(wheel) as z:
        return ast.parse(z.read(path).decode())


def _wheel_functions(tree: ast.Module, names: list[str], cls: str | None = None, scope: dict | None = None) -> dict:
    """The functions ``names`` (methods of ``cls``) of a wheel module, compiled on their own in ``scope``."""
    body = tree.body if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef)
                                              and n.name == cls).body
    fns = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert sorted(f.name for f in fns) == sorted(names), f"the wheel lacks some of {names}"
    for f in fns:
        f.decorator_list = []
    scope = {"torch": torch, "Optional": object, "Union": object, "Iterable": object, "Set": object, "List": list,
             "Dict": dict, **(scope or {})}
    exec(compile(ast.fix_missing_locations(ast.Module(fns, [])), "wheel", "exec"), scope)
    return {n: scope[n] for n in names}


# ------------------------------------------------------------------------------ contract from the wheel
def test_lora_endpoints_and_flags_are_the_wheels():
    """The request classes of the LoRA endpoints, lora_path on /generate and the LoRA server flags, as the committed
    contract (equal to the wheel: test_sglang_contract.py) records them, fit what our client and launcher send."""
    c = load_contract()
    load = c.data["classes"]["LoadLoRAAdapterReqInput"]["fields"]
    assert {k: (v["type"], v["required"]) for k, v in load.items() if k in ("lora_name", "lora_path", "pinned")} == {
        "lora_name": ("str", True), "lora_path": ("str", True), "pinned": ("bool", False)}
    assert c.data["classes"]["UnloadLoRAAdapterReqInput"]["fields"]["lora_name"]["required"]
    assert {"/load_lora_adapter", "/unload_lora_adapter"} <= ADMIN_ENDPOINTS
    assert all(c.auth_level(p) == "ADMIN_OPTIONAL" for p in ("/load_lora_adapter", "/unload_lora_adapter"))
    # lora_path on the api/v1 gate: a name or a list of names and nulls
    assert c.data["classes"]["GenerateRequest"]["fields"]["lora_path"]["type"] == "Optional[OptionalStringOrList]"
    c.check_request("/generate", {"input_ids": [[1], [2]], "lora_path": ["v1", None]})
    with pytest.raises(ContractError, match="lora_path"):
        c.check_request("/generate", {"input_ids": [[1]], "lora_path": [1]})
    # the flags: every one the launcher emits is a field of SGLang's Lora namespace, of the type we give it
    opts = c.data["lora"]["server_options"]
    launch = SGLangLaunchOptions().with_lora(8, ["all-linear"], live_versions=3)
    flags = [a for a in launch.lora_args() if a.startswith("--")]
    assert flags == ["--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch",
                     "--max-loaded-loras"]
    types_ = {f: opts[f[2:].replace("-", "_")]["type"] for f in flags}
    assert types_ == {"--enable-lora": "Optional[bool]", "--max-lora-rank": "Optional[int]",
                      "--lora-target-modules": "Optional[Union[set[str], List[str]]]",
                      "--max-loras-per-batch": "int", "--max-loaded-loras": "Optional[int]"}
    assert list(SGLANG_LORA_TARGETS) == c.data["lora"]["target_modules"]
    assert set(launch.lora_target_modules) == set(ALL)
    # live versions + 1 adapters load at once (the next before the oldest leaves), plus the base in a batch
    assert (launch.max_loaded_loras, launch.max_loras_per_batch) == (5, 5)


@pytest.mark.e2e
def test_the_launcher_puts_the_lora_flags_on_sglangs_command_line(tmp_path):
    """SGLangEngine.launch starts the server with the LoRA flags (the stand-in takes SGLang's command line and
    serves adapters only with them)."""
    opts = SGLangLaunchOptions(server_module="rollout_sglang.testing.sglang_standin", startup_timeout_s=120,
                               log_dir=tmp_path).with_lora(4, ALL, live_versions=1)
    model = tmp_path / "model"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_qwen2_config()).save_pretrained(model)
    engine = SGLangEngine.launch(model, opts)
    try:
        log = next(tmp_path.glob("sglang_*.log")).read_text()
        ignored = [line for line in log.splitlines() if "ignoring SGLang flags" in line]
        assert not any("lora" in line for line in ignored), ignored
        with pytest.raises(SGLangError, match="does not exist"):  # LoRA is on: the server knows the endpoint
            engine.unload_adapter("v1")
    finally:
        engine.shutdown()


def test_peft_names_map_to_the_modules_sglang_adapts(wheel, base):
    """SGLang's own name normalisation (lora/utils.py) and weight stacking (lora/lora.py), run from the wheel on the
    tensors our Adapter carries, give the stand-in's names and shapes, and every weight lands in a module SGLang
    adapts with the shape of its adapter buffer."""
    utils = _wheel_functions(_wheel_source(wheel, "sglang/srt/lora/utils.py"),
                             ["get_normalized_target_modules", "get_target_module_name", "get_stacked_multiply"])
    lora = _wheel_functions(_wheel_source(wheel, "sglang/srt/lora/lora.py"),
                            ["normalize_qkv_proj", "normalize_gate_up_proj"], cls="LoRAAdapter")
    adapter = _adapter(base, 1, 4, ALL)
    targets = utils["get_normalized_target_modules"](adapter.config["target_modules"])
    assert targets == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    this = types.SimpleNamespace(_is_non_gated_moe_weight=lambda name: False)
    partial = {k: v for k, v in adapter.tensors.items() if "k_proj" not in k and "up_proj" not in k}
    for tensors in (adapter.tensors, partial):  # SGLang fills a missing k or up with zeros
        theirs = dict(tensors)
        lora["normalize_qkv_proj"](this, list(theirs), theirs)
        lora["normalize_gate_up_proj"](this, list(theirs), theirs)
        ours = normalize_weights(tensors)
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    geometry = Geometry.of(base.config, tp=1)
    for name, t in normalize_weights(adapter.tensors).items():
        module = utils["get_target_module_name"](name, targets)
        assert name.startswith("base_model.model.model.layers.") and f".{module}.lora_" in name
        want_a, want_b = geometry.buffer_shapes(module, adapter.rank)
        assert tuple(t.shape) == (want_a if ".lora_A." in name else want_b), name
        assert want_a[0] == adapter.rank * utils["get_stacked_multiply"](module)
    with pytest.raises(LoraRefused, match="needs .*v_proj"):  # SGLang's loader fails on q without v (KeyError)
        normalize_weights({k: v for k, v in adapter.tensors.items() if "v_proj" not in k})


@pytest.mark.parametrize("tp", [2, 4])
def test_standin_slices_each_rank_as_sglang_does(wheel, base, tp):
    """The stand-in's TP slices equal those of SGLang's slice_lora_a/b_weights (lora/layers.py), run from the wheel
    on layers shaped as SGLang's parallel linear layers (layers/linear.py); at TP=4 the 2 KV heads are replicated."""
    tree = _wheel_source(wheel, "sglang/srt/lora/layers.py")
    scope = {"get_group_rank_size": lambda group: group}
    cls_names = {"qkv_proj": "QKVParallelLinearWithLoRA", "gate_up_proj": "MergedColumnParallelLinearWithLoRA",
                 "o_proj": "RowParallelLinearWithLoRA", "down_proj": "RowParallelLinearWithLoRA"}
    fns = {m: _wheel_functions(tree, ["slice_lora_a_weights", "slice_lora_b_weights"], cls=c, scope=scope)
           for m, c in cls_names.items()}
    cfg = base.config
    d, heads, kv, inter = cfg.hidden_size // cfg.num_attention_heads, cfg.num_attention_heads, \
        cfg.num_key_value_heads, cfg.intermediate_size
    geometry = Geometry.of(cfg, tp)
    ours = {k: v for k, v in normalize_weights(_adapter(base, 1, 5, ALL).tensors).items() if ".layers.0." in k}
    for rank in range(tp):
        kv_heads = 1 if tp >= kv else kv // tp
        layers = {  # the attributes SGLang's layers compute (linear.py: QKVParallelLinear, MergedColumn..., Row...)
            "qkv_proj": dict(q_proj_shard_size=heads // tp * d, kv_proj_shard_size=kv_heads * d,
                             num_kv_head_replicas=max(1, tp // kv), total_num_heads=heads, total_num_kv_heads=kv,
                             head_size=d, tp_group=(rank, tp), kv_tp_group=(rank, tp)),
            "gate_up_proj": dict(output_sizes=[inter, inter], output_partition_sizes=[inter // tp] * 2,
                                 tp_group=(rank, tp)),
            "o_proj": dict(input_size_per_partition=heads * d // tp, tp_group=(rank, tp)),
            "down_proj": dict(input_size_per_partition=inter // tp, tp_group=(rank, tp)),
        }
        for module, attrs in layers.items():
            a = next(v for k, v in ours.items() if f".{module}.lora_A" in k)
            b = next(v for k, v in ours.items() if f".{module}.lora_B" in k)
            this = types.SimpleNamespace(base_layer=types.SimpleNamespace(**attrs))
            want = fns[module]["slice_lora_a_weights"](this, a), fns[module]["slice_lora_b_weights"](this, b)
            got = geometry.slice(module, a, b, rank)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (module, rank)
            assert (tuple(got[0].shape), tuple(got[1].shape)) == geometry.buffer_shapes(module, 4)


def test_lora_bodies_pass_sglangs_decoder(api_types, base, adapters):
    """What the client sends (recorded by the stand-in) fits the request classes, and /generate with lora_path
    passes SGLang's own generated api/v1 decoder."""
    api = api_types
    three = adapters[0]
    with Served(base, **LORA) as s:
        s.client.load_adapter(three)
        asyncio.run(s.client.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=2, seed=1),
                                      adapters=["v3", None]))
        s.client.unload_adapter("v3")
        bodies = list(s.server.bodies)
    contract = load_contract()
    sent = {p: b for p, b in bodies}
    assert sent["/load_lora_adapter"] == {"lora_name": "v3", "lora_path": three.path, "pinned": False}
    assert sent["/unload_lora_adapter"] == {"lora_name": "v3"}
    assert sent["/generate"]["lora_path"] == ["v3", None]
    for p, b in bodies:
        contract.check_request(p, b)
    api.GenerateRequest.from_json_value(sent["/generate"])


# ----------------------------------------------------------------------------- client <-> stand-in
def test_rows_follow_their_adapter_as_the_local_engine_serves_it(base, adapters):
    """Two adapters on one stand-in: a batch with per-row adapters samples what the local engine samples with the
    same adapters, each row stamped with its adapter's version; unloading leaves the others served."""
    three, five, _ = adapters
    local = LocalEngine(copy.deepcopy(base), seed=0)
    local.load_adapter(Adapter.load(three.path, 3))
    local.load_adapter(Adapter.load(five.path, 5))
    prompts = [[5, 9, 11, 3], [7, 7, 1], [2, 4, 6, 8, 10], [12, 1]]
    names = ["v3", None, "v5", "v3"]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    want = asyncio.run(local.generate(prompts, params, adapters=names))
    with Served(base, **LORA) as s:
        assert isinstance(s.client, AdapterEngine)
        s.client.load_adapter(three)
        s.client.load_adapter(five)
        got = asyncio.run(s.client.generate(prompts, params, adapters=names))
        assert [o.version for o in got] == [3, 0, 5, 3]
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5)
        plain = asyncio.run(s.client.generate(prompts[:1], params))
        assert plain[0].token_ids != got[0].token_ids  # the adapter changes what is sampled
        s.client.unload_adapter("v3")
        assert s.client.adapters == ["v5"] and sorted(s.server.lora.loaded()) == ["v5"]
        with pytest.raises(ValueError, match=r"\['v3'\] were not loaded"):
            asyncio.run(s.client.generate(prompts[:1], params, adapters=["v3"]))
        again = asyncio.run(s.client.generate(prompts[2:3], params, adapters=["v5"]))
        assert again[0].version == 5


def test_refusals_name_the_adapter_the_server_and_sglangs_reason(base, adapters):
    three, five, wide = adapters
    with pytest.raises(ValueError, match=r"no path.*Adapter.save"):
        SGLangEngine("http://127.0.0.1:1").load_adapter(Adapter(1, three.config, three.tensors))
    with pytest.raises(EngineUnavailable, match="could not be reached"):
        SGLangEngine("http://127.0.0.1:1", SGLangClientOptions(update_timeout_s=2)).load_adapter(three)
    with Served(base) as s:  # without --enable-lora
        with pytest.raises(SGLangError, match=r"adapter v3 .* on http://.*--enable-lora"):
            s.client.load_adapter(three)
    with Served(base, **{**LORA, "lora_target_modules": ("q_proj", "k_proj", "v_proj", "o_proj")}) as s:
        with pytest.raises(SGLangError, match=r"v9 with rank 8 is incompatible .*--max-lora-rank"):
            s.client.load_adapter(wide)
        with pytest.raises(SGLangError, match=r"v3 with rank 4 is incompatible .*--lora-target-modules"):
            s.client.load_adapter(three)  # it adapts the MLP too
        s.client.load_adapter(five)
        with pytest.raises(SGLangError, match="v5 because it is already loaded"):
            s.client.load_adapter(five)
        with pytest.raises(SGLangError, match=r"unloading LoRA adapter v7 .*LoRA with name v7 does not exist"):
            s.client.unload_adapter("v7")
        body = {"input_ids": [[1, 2]], "sampling_params": [{"max_new_tokens": 2}], "lora_path": ["v7"]}
        r = httpx.post(f"{s.server.url}/generate", json=body, timeout=30)
        assert r.status_code == 400 and "never been loaded: v7" in r.json()["error"]["message"]


def test_too_many_adapters_evict_the_least_recently_used(base, adapters, tmp_path):
    """At --max-loaded-loras SGLang unloads the least recently used adapter; a request naming it loads it again from
    its path, and a request with more distinct adapters than the limit is refused."""
    three, five, _ = adapters
    other = Adapter.load(three.path, 4)
    other.save(tmp_path / "v4")
    with Served(base, **{**LORA, "max_loras_per_batch": 2, "max_loaded_loras": 2}) as s:
        s.client.load_adapter(three)
        s.client.load_adapter(five)
        asyncio.run(s.client.generate([[1, 2]], SamplingParams(max_new_tokens=1), adapters=["v3"]))  # v5 is now LRU
        s.client.load_adapter(other)
        assert sorted(s.server.lora.loaded()) == ["v3", "v4"]
        out = asyncio.run(s.client.generate([[1, 2]], SamplingParams(max_new_tokens=1), adapters=["v5"]))
        assert out[0].version == 5 and "v5" in s.server.lora.loaded()
        with pytest.raises(SGLangError, match="3 unique loras requested but max loaded loras is 2"):
            asyncio.run(s.client.generate([[1], [2], [3]], SamplingParams(max_new_tokens=1),
                                          adapters=["v3", "v4", "v5"]))


def test_a_shape_sglang_cannot_slice_is_refused(base, adapters):
    """At --tp-size 3 the 4 attention heads do not divide: SGLang's divide() message."""
    with Served(base, **LORA, tp_size=3) as s:
        with pytest.raises(SGLangError, match="4 is not divisible by 3"):
            s.client.load_adapter(adapters[0])
    with Served(base, **LORA, tp_size=2) as s:
        s.client.load_adapter(adapters[0])
