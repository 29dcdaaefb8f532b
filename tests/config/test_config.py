"""params.yaml is validated before anything runs; a bad key fails with its name."""

from pathlib import Path

import pytest
import yaml

from xbn.cli import main
from xbn.config import ConfigError, Params, flatten, load_params

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_params_match_the_schema_defaults():
    shipped = load_params(ROOT / "params.yaml")
    assert shipped == Params(), "params.yaml and the schema defaults drifted apart"


def test_overrides_parse_types():
    p = load_params(ROOT / "params.yaml", ["memory.method=xbn", "memory.kalman.r=1e-3", "eval.k=[1, 5]",
                                           "model.pretrained_path=null", "train.amp=false"])
    assert (p.memory.method, p.memory.kalman.r, p.eval.k, p.model.pretrained_path, p.train.amp) == \
        ("xbn", 1e-3, [1, 5], None, False)


@pytest.mark.parametrize("override, named", [
    ("memory.kalman.rr=1", "memory.kalman.rr"),
    ("memroy.method=xbn", "memroy"),
    ("memory.kalman.q=0", "memory.kalman.q"),
    ("memory.size=0", "memory.size"),
    ("memory.size=1.5", "memory.size"),
    ("train.batch_size=30", "train.batch_size"),
    ("train.epochs=many", "train.epochs"),
    ("memory.method=magic", "memory.method"),
    ("eval.k=[0]", "eval.k"),
    ("data.val_classes=1.0", "data.val_classes"),
])
def test_bad_values_are_refused_by_key(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_params(ROOT / "params.yaml", [override])


@pytest.mark.parametrize("override", ["train.lr=true", "registry.min_improvement=true", "train.epochs=false",
                                      "memory.size=true", "train.seed=true"])
def test_a_boolean_is_not_a_number(override):
    # Issue 41: pydantic's lax mode read `true` as 1 (lr 1.0; a min_improvement that promotes nothing ever).
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}: a number, not the boolean"):
        load_params(ROOT / "params.yaml", [override])
    # A key that takes a boolean or a word keeps it.
    assert load_params(ROOT / "params.yaml", ["train.channels_last=true"]).train.channels_last is True


@pytest.mark.parametrize("override", ["train.channels_last._=null", "memory.start=soon"])
def test_a_union_key_is_named_without_pydantics_member_tags(override):
    # found by the property test: the key was printed as `train.channels_last.literal['auto']`
    key = override.split("=")[0].removesuffix("._")
    with pytest.raises(ConfigError) as info:
        load_params(None, [override])  # no file: the override makes channels_last a mapping, as in that test
    assert f"{key}: " in str(info.value) and "literal[" not in str(info.value)


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"train": {"epochs": 1, "lerning_rate": 0.1}}))
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lerning_rate'"):
        load_params(path)


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_params(None, ["memory.method"])
    with pytest.raises(ConfigError, match="not found"):
        load_params(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_params(ROOT / "params.yaml", ["memory.method.x=1"])
    with pytest.raises(ConfigError, match=r"memory\.method"):
        load_params(None, ["memory.method.x=1"])


def test_cli_exits_nonzero_naming_the_key_before_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--params", str(ROOT / "params.yaml"), "--set", "memory.kalman.qq=1"])
    assert code == 2
    assert "memory.kalman.qq" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()


def test_flatten():
    flat = flatten(Params())
    assert flat["memory.kalman.r"] == 0.01 and flat["loss.params.temperature"] == 0.1
    assert flat["eval.k"] == [1, 2, 4, 8, 10, 100]
