"""Model config: validation errors name the field; YAML with `base:` chains and key=value
overrides."""

import re

import pytest

from cem_jax.config import ModelConfig, load_model_config
from cem_jax.config_files import apply_overrides, load_section, load_yaml
from cem_jax.data.config import DataConfig


@pytest.mark.parametrize("kwargs,field", [
    (dict(d_model=30, num_heads=4), "d_model"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(steps=0), "steps"),
    (dict(activation="tanh"), "activation"),
    (dict(preconditioner="adam"), "preconditioner"),
    (dict(interaction="full"), "interaction"),
    (dict(position="alibi"), "position"),
    (dict(impl="cuda"), "impl"),
    (dict(dtype="float16"), "dtype"),
    (dict(head_dim=3, num_heads=4), "head_dim"),
    (dict(num_layers=True), "num_layers"),
    (dict(tie_mlp="yes"), "tie_mlp"),
    (dict(norm_eps=0.0), "norm_eps"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        ModelConfig(**kwargs)


def test_derived_shapes():
    cfg = ModelConfig(d_model=64, num_heads=8, num_kv_heads=2)
    assert (cfg.head_width, cfg.kv_heads) == (8, 2)
    assert ModelConfig(d_model=64, num_heads=8, head_dim=16).head_width == 16


def test_yaml_with_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("model:\n  d_model: 64\n  num_heads: 4\n  tie_mlp: false\nother: {a: 1}\n")
    cfg = load_model_config(path, ["steps=2", "model.preconditioner=diag", "tie_mlp=true"])
    assert (cfg.d_model, cfg.steps, cfg.preconditioner, cfg.tie_mlp) == (64, 2, "diag", True)
    assert apply_overrides({"a": {"b": 1}}, ["a.c=null", "d.e=x=y"]) == \
        {"a": {"b": 1, "c": None}, "d": {"e": "x=y"}}
    assert load_model_config(None, ["norm_eps=1e-6", "rope_theta=500000"]).norm_eps == 1e-6
    # What YAML would read as a mapping, a date, an alias or a syntax error stays the string.
    got = apply_overrides({}, ["r.prompt=KING:", "r.dir=2024-01-01", "d.corpus=*.txt",
                               "r.x=[oops", "r.n=3", "r.f=2.5", "r.b=false"])
    assert got == {"r": {"prompt": "KING:", "dir": "2024-01-01", "x": "[oops", "n": 3,
                         "f": 2.5, "b": False}, "d": {"corpus": "*.txt"}}


def test_yaml_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="is a directory"):
        load_model_config(tmp_path)
    (tmp_path / "binary.yaml").write_bytes(b"\xd0\xff\x00")
    with pytest.raises(ValueError, match="binary.yaml' is not UTF-8 text"):
        load_model_config(tmp_path / "binary.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_modle: 64\n")
    with pytest.raises(ValueError, match="unknown config field 'd_modle'.*did you mean 'd_model'"):
        load_model_config(bad)
    bad.write_text("model: 5\n")
    with pytest.raises(ValueError, match="section 'model' must be a mapping"):
        load_model_config(bad)
    with pytest.raises(ValueError, match="must look like section.key=value"):
        load_model_config(None, ["steps"])
    with pytest.raises(ValueError, match="'model.steps'"):
        load_model_config(None, ["steps=-1"])


def test_base_chain_merges_section_by_section(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text(
        "model: {d_model: 64, num_heads: 4, steps: 3}\nother: {a: 1, b: 2}\ntop: 1\n")
    (tmp_path / "sub" / "mid.yaml").write_text(
        "base: ../root.yaml\nmodel: {steps: 2, tie_mlp: false}\nother: {b: null}\n")
    (tmp_path / "leaf.yaml").write_text("base: sub/mid.yaml\nmodel:\ntop: {x: 1}\n")
    monkeypatch.chdir(tmp_path / "sub")  # a base is relative to its file, not to the cwd
    assert load_yaml(tmp_path / "leaf.yaml") == {
        "model": {"d_model": 64, "num_heads": 4, "steps": 2, "tie_mlp": False},
        "other": {"a": 1, "b": None}, "top": {"x": 1}}
    cfg = load_model_config(tmp_path / "leaf.yaml", ["steps=5"])
    assert (cfg.d_model, cfg.steps, cfg.tie_mlp) == (64, 5, False)


def test_base_errors_name_both_files(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("base: b.yaml\n")
    b.write_text("base: ./a.yaml\nmodel: {steps: 2}\n")
    with pytest.raises(ValueError, match=re.escape(
            f"'{b}' names base './a.yaml', which leads back to itself ({a} -> {b} -> {a})")):
        load_yaml(a)
    b.write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"'{b}' names base 'missing.yaml', but '{tmp_path / 'missing.yaml'}' does not exist")):
        load_yaml(a)
    a.write_text("base: [b.yaml]\n")
    with pytest.raises(ValueError, match=r"a.yaml': base must be the path of a YAML file"):
        load_yaml(a)
    a.write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match="leads back to itself"):
        load_yaml(a)


def test_a_bad_field_names_the_file_of_the_chain_that_sets_it(tmp_path):
    from cem_jax.train_config import load_config
    root, leaf = tmp_path / "root.yaml", tmp_path / "leaf.yaml"
    root.write_text("model: {nmu_layers: 2, d_model: 64, num_heads: 4}\n")
    leaf.write_text("base: root.yaml\nrun: {steps: 3}\n")
    for load in (load_config, load_model_config):
        with pytest.raises(ValueError, match=re.escape(
                f"config file '{root}' (the base of '{leaf}'): unknown config field "
                f"'nmu_layers' in section 'model'; did you mean 'num_layers'?")):
            load(leaf, [])
    top = tmp_path / "top.yaml"  # two steps up the chain, and a section nobody knows
    top.write_text("base: leaf.yaml\n")
    with pytest.raises(ValueError, match=re.escape(
            f"config file '{root}' (the base of '{leaf}', the base of '{top}'): unknown config "
            f"field 'nmu_layers'")):
        load_config(top, [])
    root.write_text("modle: {num_layers: 2}\n")
    with pytest.raises(ValueError, match=re.escape(
            f"config file '{root}' (the base of '{leaf}', the base of '{top}'): unknown config "
            f"section(s) ['modle']")):
        load_config(top, [])
    root.write_text("model: {num_layers: 0}\n")
    leaf.write_text("base: root.yaml\nmodel: {num_layers: -1}\n")
    with pytest.raises(ValueError, match=re.escape(
            f"config file '{leaf}': config field 'model.num_layers' = -1 is invalid")):
        load_config(leaf, [])
    with pytest.raises(ValueError, match=r"^config field 'model.num_layers' = -2 is invalid"):
        load_config(leaf, ["model.num_layers=-2"])  # an override: no file to name


def test_load_section_reads_only_its_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {d_model: 64, num_heads: 4}\ndata: {seq_len: 7}\n")
    assert load_section(ModelConfig, "model", path, ["model.steps=2"]).steps == 2
    with pytest.raises(ValueError, match=r"override 'data.seq_len=9' is not in section 'model'"):
        load_section(ModelConfig, "model", path, ["data.seq_len=9"])


def test_an_override_is_read_as_the_type_of_its_field():
    """A string field takes the text after `=` as written (YAML would cut it at ` #` or read
    `'#tag'` as null); nullable strings also take null; other fields parse as before."""
    from cem_jax.train_config import load_config

    cfg = load_config(None, ["run.dir=runs/exp #2", "run.sample_prompt=Thou art #1",
                             "data.corpus=#tag", "data.val_corpus=null", "run.steps=7",
                             "optimizer.lr=3e-4", "run.progress=false", "model.dtype=bfloat16",
                             "data.tokenizer=  x #y"])
    assert (cfg.run.dir, cfg.run.sample_prompt, cfg.data.corpus) == \
        ("runs/exp #2", "Thou art #1", "#tag")
    assert (cfg.data.val_corpus, cfg.run.steps, cfg.optimizer.lr, cfg.run.progress) == \
        (None, 7, 3e-4, False)
    assert (cfg.model.dtype, cfg.data.tokenizer) == ("bfloat16", "  x #y")
    assert load_config(None, ["run.sample_prompt="]).run.sample_prompt == ""
    assert load_section(DataConfig, "data", None, ["corpus=a #b.txt"]).corpus == "a #b.txt"


@pytest.mark.parametrize("override", ["run.profile_start=abc", "run.profile_start=2.5",
                                      "run.eval_batches=abc", "mesh.num_processes=abc",
                                      "run.init_step=abc", "run.peak_flops=abc"])
def test_an_optional_number_takes_a_number_or_null(override):
    """`int | None` and `float | None` fields: null, or a number of their type (a string or a
    fraction used to pass their type check and fail later, or never)."""
    from cem_jax.train_config import load_config

    field = override.split("=")[0]
    with pytest.raises(ValueError, match=f"config field '{field}' = .* it must be of type"):
        load_config(None, [override])
    section, name = field.split(".")
    assert getattr(getattr(load_config(None, [f"{field}=null"]), section), name) is None


def test_kinds_are_chosen_by_name_or_by_the_flags():
    assert ModelConfig().kinds == ("cem_attention", "cem_mlp")
    assert ModelConfig(interaction="dplr").kinds == ("cem_dplr_attention", "cem_mlp")
    assert ModelConfig(tie_attention=False, tie_mlp=False).kinds == ("llama_attention", "swiglu")
    assert ModelConfig(attention_kind="llama_attention", mlp_kind="swiglu").kinds == (
        "llama_attention", "swiglu")
    with pytest.raises(ValueError, match="'attention_kind' = 'nope'.*one of cem_attention, "
                                         "cem_dplr_attention, llama_attention"):
        ModelConfig(attention_kind="nope")
    with pytest.raises(ValueError, match="'mlp_kind' = 'cem_attention'"):
        ModelConfig(mlp_kind="cem_attention")  # an attention kind in the MLP's place
    with pytest.raises(ValueError, match="'tie_mlp' = False .* left at its default when "
                                         "mlp_kind names the kind"):
        ModelConfig(mlp_kind="swiglu", tie_mlp=False)


def test_a_misspelt_kind_name_gets_a_suggestion():
    """As a misspelt config field does: the closest kind of the role (difflib), in the config
    and in the registry; a computed value (`model.kinds`) names the fields that set it."""
    from cem_jax.kinds import get_kind
    from cem_jax.train_config import load_config

    with pytest.raises(ValueError, match=r"'model.attention_kind' = 'llama_atention' is invalid: "
                                         r"it must be one of .*; did you mean 'llama_attention'\?"):
        load_config(None, ["model.attention_kind=llama_atention"])
    with pytest.raises(ValueError, match=r"'mlp_kind' = 'swigl' .*; did you mean 'swiglu'\?"):
        ModelConfig(mlp_kind="swigl")
    with pytest.raises(ValueError) as far:  # nothing close: no suggestion
        ModelConfig(mlp_kind="cem_attention")
    assert "did you mean" not in str(far.value)
    with pytest.raises(ValueError, match=r"unknown sub-layer kind 'cem_atention'; did you mean "
                                         r"'cem_attention'\? \(known: cem_attention, "):
        get_kind("cem_atention")
    with pytest.raises(ValueError, match=r"unknown config field 'kinds' in section 'model': it "
                                         r"is computed; set attention_kind and mlp_kind instead"):
        load_config(None, ["model.kinds=[llama_atention, swiglu]"])


def test_a_misspelt_choice_value_gets_a_suggestion():
    with pytest.raises(ValueError, match=r"'impl' = 'palas' is invalid: it must be one of "
                                         r".*; did you mean 'pallas'\?"):
        ModelConfig(impl="palas")
    with pytest.raises(ValueError, match=r"'interaction' = 'dprl' .*; did you mean 'dplr'\?"):
        ModelConfig(interaction="dprl")
