import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TRAIN, ok, python

from ddp import cli, config
from ddp.errors import UsageError


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_precedence_defaults_then_yaml_then_cli(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.5\ntrain:\n  epochs: 7\n")
    cfg = config.load(path, ["optim.lr=1e-3"])
    assert cfg.optim.lr == 0.001  # CLI beats YAML
    assert cfg.train.epochs == 7  # YAML beats the default
    assert cfg.train.batch_size == config.TrainConfig().batch_size  # untouched default


def test_values_take_the_type_of_their_field(tmp_path):
    cfg = config.load(None, ["optim.lr=1e-3", "train.epochs=3", "run.compile=true", "run.channels_last=0"])
    assert (type(cfg.optim.lr), type(cfg.train.epochs)) == (float, int)
    assert cfg.run.compile is True and cfg.run.channels_last is False
    # PyYAML reads 1e-3 as a string and YAML 1.1 reads `off` as false: both land as the field's type.
    cfg = config.load(write(tmp_path, "optim:\n  lr: 1e-3\n  weight_decay: 0\nrun:\n  amp: off\n"))
    assert cfg.optim.lr == 0.001 and cfg.optim.weight_decay == 0.0 and cfg.run.amp == "off"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.epochs=abc", "train.epochs: expected int, got 'abc'"),
        ("train.epochs=2.5", "train.epochs: expected int"),
        ("run.compile=maybe", "run.compile: expected bool"),
        ("train.eval_every=1.5", "train.eval_every: expected int"),
        ("train.eval_every=often", "train.eval_every: expected int"),
        ("run.amp=fp8", "run.amp: 'fp8' is not one of off, bf16, fp16"),
        ("data.dataset=imagenet", "not one of cifar10, cifar100, npz, synthetic"),
        ("optim.lr", "overrides are section.key=value"),
        ("configs/fast.yaml", "e.g. optim.lr=0.1; a config file goes after --config: --config configs/fast.yaml"),
        ("lr=0.1", "keys are section.key"),
    ],
)
def test_bad_values_are_usage_errors(override, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        config.load(None, [override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.epochs=0", "train.epochs=0 is out of range: it must be >= 1"),
        ("data.synthetic_test=" + "9" * 20, "is out of range: it must be in [1, 1000000000]"),  # torch's traceback
        ("train.epochs=-1", "train.epochs=-1 is out of range: it must be >= 1"),
        ("train.eval_every=0", "train.eval_every=0 is out of range: it must be >= 1"),
        ("train.eval_every=-2", "train.eval_every=-2 is out of range: it must be >= 1"),
        ("train.batch_size=0", "train.batch_size=0 is out of range: it must be >= 1"),
        ("train.eval_batch_size=0", "train.eval_batch_size=0 is out of range"),
        ("train.label_smoothing=1", "train.label_smoothing=1.0 is out of range: it must be in [0, 1)"),
        ("train.label_smoothing=-0.1", "train.label_smoothing=-0.1 is out of range"),
        ("optim.lr=0", "optim.lr=0.0 is out of range: it must be > 0"),
        ("optim.lr=-0.1", "optim.lr=-0.1 is out of range"),
        ("optim.lr=nan", "optim.lr: expected a finite float, got 'nan'"),
        ("optim.lr=inf", "optim.lr: expected a finite float, got 'inf'"),
        ("optim.momentum=1", "optim.momentum=1.0 is out of range: it must be in [0, 1)"),
        ("optim.weight_decay=-1e-4", "optim.weight_decay=-0.0001 is out of range: it must be >= 0"),
        ("optim.warmup_epochs=-1", "optim.warmup_epochs=-1.0 is out of range"),
        ("optim.clip_grad_norm=-1", "optim.clip_grad_norm=-1.0 is out of range: it must be >= 0"),
        ("run.keep_last=0", "run.keep_last=0 is out of range: it must be >= 1"),
        (
            "ddp.bucket_cap_mb=1e300",
            "ddp.bucket_cap_mb=1e+300 is out of range: it must be in (0, 1048576]",
        ),  # DDP's int
        (
            "data.synthetic_classes=100000000",
            "data.synthetic_classes=100000000 is out of range: it must be in [2, 100000]",
        ),
        ("run.timeout_s=0", "run.timeout_s=0 is out of range: it must be in [1, 1000000000]"),
        # a timedelta of it overflowed (OverflowError under torchrun), torch's store's nanoseconds too (~9e9 s)
        (
            "run.timeout_s=100000000000000",
            "run.timeout_s=100000000000000 is out of range: it must be in [1, 1000000000]",
        ),
        ("run.save_every_steps=-1", "run.save_every_steps=-1 is out of range: it must be >= 0"),
        ("run.seed=-1", "run.seed=-1 is out of range: it must be in [0, 4294967295]"),
        ("run.seed=4294967296", "run.seed=4294967296 is out of range"),
        ("data.workers=-1", "data.workers=-1 is out of range: it must be >= 0"),
        ("data.synthetic_train=0", "data.synthetic_train=0 is out of range: it must be in [1, 1000000000]"),
    ],
)
def test_numbers_out_of_their_range_are_usage_errors(override, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        config.load(None, [override])


KEYS = {
    f"{s.name}.{f.name}": f for s in dataclasses.fields(config.Config) for f in dataclasses.fields(s.default_factory())
}


def mistypes(f: dataclasses.Field) -> tuple[list[str], list[tuple[str, str]]]:
    """What its declaration says of a key: the values at its range's closed ends (valid), and values a user could
    mistype with the words of each one's error: of another type, just outside its range, not one of its choices."""
    kind, valid, choices = type(f.default), f.metadata["valid"], f.metadata["choices"]
    bad = {bool: [("maybe", "expected bool"), ("2", "expected bool")], int: [("1.5", "expected int"),
           ("many", "expected int")], float: [("x", "expected float"), ("nan", "expected a finite float"),
           ("-inf", "expected a finite float")]}.get(kind, [])  # fmt: skip
    bad += [(f"not-{choices[0]}", "is not one of")] if choices else []
    ends, show = [], int if kind is int else float
    for end, is_open, step in ((valid.low, valid.low_open, -1), (valid.high, valid.high_open, 1)) if valid else ():
        if end is not None:
            bad.append((str(show(end if is_open else end + step)), "is out of range: it must be"))
            ends += [] if is_open else [str(show(end))]
    return ends, bad


@pytest.mark.parametrize("key", sorted(KEYS))
def test_every_key_takes_the_ends_of_its_range_and_refuses_what_its_declaration_does_not_allow_in_one_line(
    key, tmp_path
):
    """From each key's declaration (its type, Range, choices), so a key added later is covered: a value of another
    type, one just outside its range, one not among its choices are each a UsageError naming the key, on the
    command line and in a YAML file (where 1.5 and 2 are numbers already); the closed ends of its range are valid."""
    ends, bad = mistypes(KEYS[key])
    section, name = key.split(".")
    for value in ends:
        assert config.load(None, [f"{key}={value}"]) == config.load(write(tmp_path, f"{section}:\n  {name}: {value}\n"))
    for value, words in bad:
        for given in (None, [f"{key}={value}"]), (write(tmp_path, f"{section}:\n  {name}: {value}\n"), []):
            with pytest.raises(UsageError) as said:
                config.load(*given)
            assert key in str(said.value) and words in str(said.value), (given, str(said.value))


def test_the_range_ends_are_valid_and_shown_in_help():
    cfg = config.load(
        None, ["train.epochs=1", "optim.momentum=0", "train.label_smoothing=0.999", "run.seed=4294967295"]
    )
    assert (cfg.train.epochs, cfg.optim.momentum, cfg.run.seed) == (1, 0.0, 2**32 - 1)
    reference = config.reference()
    assert "train.epochs (int >= 1, default 30)" in reference and "optim.lr (float > 0, default 0.1)" in reference
    assert "optim.momentum (float in [0, 1), default 0.9)" in reference
    with pytest.raises(UsageError, match="train.epochs=0 is out of range"):  # in a YAML file too
        config.from_dict({"train": {"epochs": 0}})


def test_unknown_key_lists_the_valid_keys_of_its_section():
    with pytest.raises(UsageError) as e:
        config.load(None, ["optim.lrr=0.1"])
    text = str(e.value)
    assert "unknown key 'optim.lrr'" in text and "did you mean 'optim.lr'" in text
    assert "valid keys in optim: name, lr, momentum, nesterov, weight_decay, schedule, final_lr" in text
    assert "whiten_bias_epochs, warmup_epochs, warmup_from, clip_grad_norm" in text


def test_unknown_section_and_yaml_key(tmp_path):
    with pytest.raises(UsageError, match="unknown section 'optm'.*did you mean 'optim'"):
        config.load(None, ["optm.lr=0.1"])
    with pytest.raises(UsageError, match="unknown key 'train.epoch'"):
        config.load(write(tmp_path, "train:\n  epoch: 3\n"))


@pytest.mark.parametrize("key", sorted(config.PATHS))
def test_a_path_with_a_nul_character_is_one_line(key, tmp_path):
    """YAML's "\\0" in a double-quoted path (argv can hold none): os.stat's or mkdir's ValueError traceback."""
    section, name = key.split(".")
    with pytest.raises(UsageError, match=re.escape(f"{key}: 'a\\x00b' holds a NUL character, which no path can")):
        config.load(write(tmp_path, f'{section}:\n  {name}: "a\\0b"\n'))


def test_bad_yaml_names_the_line(tmp_path):
    with pytest.raises(UsageError, match=r"c.yaml: line 3: invalid YAML"):
        config.load(write(tmp_path, "optim:\n  lr: 0.1\n   momentum: 0.9\nrun:\n  seed: 1\n"))
    with pytest.raises(UsageError, match="config file not found"):
        config.load(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    "text, said",
    [
        (
            "optim:\n  lr: 0.1\ntrain:\n  epochs: 3\noptim:\n  momentum: 0.5\n",
            "line 5: invalid YAML: 'optim' is given twice",
        ),
        ("optim:\n  lr: 0.1\n  lr: 0.2\n", "line 3: invalid YAML: 'lr' is given twice"),
        (b"\xa3\x00 binary", "invalid YAML: 'utf-8' codec can't decode byte 0xa3 in position 0"),
        (
            b"\x00\x01 binary",
            "invalid YAML: unacceptable character #x0000: special characters are not allowed in "
            '"<unicode string>", position 0',
        ),  # fmt: skip
        ("run: " + "[" * 5000, "invalid YAML: nested too deeply for a config (sections of keys)"),
        (b"run: {}\n" + b"#" * 2**20, "more than 1 MiB, not a config file; name a YAML file, e.g. configs/quick.yaml"),
        (
            "train:\n\tepochs: 3\n",
            "line 2: invalid YAML: found character '\\t' that cannot start any token (YAML takes "
            "spaces there, never tabs)",
        ),
    ],
    ids=[
        "a-section-twice",
        "a-key-twice",
        "not-text",
        "text-but-not-yaml",
        "nested-too-deep",
        "larger-than-1MiB",
        "a-tab",
    ],
)
def test_a_config_that_says_a_thing_twice_or_is_no_text_is_refused(text, said, tmp_path):
    """PyYAML keeps the last of a key given twice: the first optim section's lr was dropped without a word.
    A binary file was a UnicodeDecodeError traceback; lists nested 5000 deep a RecursionError's; /dev/zero (or any
    file too large for a config) was read whole, a MemoryError or the OOM killer. (A YAML merge key still merges.)"""
    path = tmp_path / "c.yaml"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(UsageError) as refused:
        config.load(str(path))
    assert str(refused.value).startswith(f"{path}: {said}") and "\n" not in str(refused.value), refused.value
    merged = write(tmp_path, "run:\n  <<: {seed: 5, progress: false}\n  seed: 7\n")
    assert (config.load(merged).run.seed, config.load(merged).run.progress) == (7, False)


@pytest.mark.parametrize(
    "text, said",
    [
        ("epochs: 3\noptim:\n  lr: 0.2\n", "write 'epochs: 3' as 'train:\\n  epochs: 3'"),  # a flat config's
        ("train.epochs: 3\n", "write 'train.epochs: 3' as 'train:\\n  epochs: 3'"),  # as a command line has it
        ("name: fast\n", "write 'name: fast' as 'model:\\n  name: fast' or 'optim:\\n  name: fast'"),
        ("epoks: 3\n", "e.g. 'optim:\\n  lr: 0.1'"),  # no section has the key
        ("- optim\n", "e.g. 'optim:\\n  lr: 0.1'"),
        ("epochs: [&a [1, 1, 1], &b [*a, *a, *a], [*b, *b, *b]]\n", "write 'epochs: ...' as 'train:\\n  epochs: ...'"),
    ],
    ids=["flat", "dotted", "in-two-sections", "unknown", "a-list", "a-list-value"],
)
def test_a_setting_outside_a_section_is_shown_in_its_section(text, said, tmp_path):
    """A flat config (`epochs: 3`, as many a script's) or a setting as the command line writes it (`train.epochs: 3`)
    was refused with an example of a section alone; the line now writes that setting in its section (a list's items
    not shown: YAML's aliases make a billion of a few hundred bytes)."""
    with pytest.raises(UsageError) as refused:
        config.load(write(tmp_path, text))
    assert str(refused.value) == f"{tmp_path / 'c.yaml'}: expected sections of keys; {said}"


def test_a_section_whose_keys_are_all_commented_out_is_empty_and_its_name_still_checked(tmp_path):
    """`train:` with its one key commented out was refused as no sections of keys; it sets nothing. A misspelt
    section that sets nothing is still refused by its name, as one with keys is."""
    cfg = config.load(write(tmp_path, "train:\n#  epochs: 3\noptim:\n  lr: 0.25\n"))
    assert (cfg.train.epochs, cfg.optim.lr) == (config.Config().train.epochs, 0.25)
    with pytest.raises(UsageError) as refused:
        config.load(write(tmp_path, "trian:\noptim:\n  lr: 0.25\n"))
    assert str(refused.value) == ("unknown section 'trian' (did you mean 'train'?); sections: data, model, train, "
                                  "optim, ddp, run")  # fmt: skip


@pytest.mark.parametrize("key, kind", [("train.epochs", "int"), ("optim.lr", "float"), ("run.compile", "bool"),
                                       ("data.root", "str")])  # fmt: skip
def test_a_list_where_a_setting_goes_is_one_short_line_however_many_items_its_aliases_make(key, kind, tmp_path):
    """350 bytes of YAML aliases, each list ten of the one before, are a billion items: given as train.epochs they
    ran for minutes and took gigabytes (their str() for int(), then their repr in the line), a hang."""
    laughs = ["&a [x, x, x, x, x, x, x, x, x, x]"]
    laughs += [f"&{b} [{', '.join(['*' + a] * 10)}]" for a, b in zip("abcdefgh", "bcdefghi")]
    section, name = key.split(".")
    with pytest.raises(UsageError, match=f"^{key}: expected {kind}, got a list$"):
        config.load(write(tmp_path, f"{section}:\n  {name}: [{', '.join(laughs)}]\n"))
    with pytest.raises(UsageError, match=f"^{key}: expected {kind}, got a mapping$"):
        config.load(write(tmp_path, f"{section}:\n  {name}: {{a: 1}}\n"))


@pytest.mark.parametrize("given", ["run.out_dir=", "data.root=", "run.stop_signal=", "run.device="])
def test_a_key_set_empty_is_refused_where_empty_is_not_a_value(given, tmp_path):
    """`run.out_dir=$DIR` with DIR unset trained into the current directory (checkpoints/, metrics.jsonl,
    config.yaml and .lock among the user's files). Keys whose default is empty take it (data.path, run.profile);
    in a YAML file, an empty value is refused alike."""
    section, name = given.rstrip("=").split(".")
    said = f"{section}.{name} is empty: give it a value, or leave it out for its default "
    said += repr(config.to_dict(config.Config())[section][name])
    for text, overrides in (None, [given]), (f"{section}:\n  {name}: ''\n", []):  # the command line, a file
        with pytest.raises(UsageError, match=f"^{re.escape(said)}$"):
            config.load(write(tmp_path, text) if text else None, overrides)
    assert config.load(None, ["data.path=", "run.profile="]).data.path == ""


def test_a_paths_environment_variables_are_their_values_and_one_not_set_is_refused(tmp_path, monkeypatch):
    """A config file's `out_dir: $SCRATCH/runs/a` (a cluster's way) made a folder named "$SCRATCH" in the current
    one, and with SCRATCH unset the same. Paths take $NAME and ${NAME} as a shell does; one not set is one line."""
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    monkeypatch.delenv("DDP_CIFAR_UNSET", raising=False)
    (tmp_path / "x.yaml").write_text("run:\n  out_dir: $SCRATCH/runs/a\ndata:\n  path: ${SCRATCH}/d.npz\n")
    cfg = config.load(str(tmp_path / "x.yaml"), ["data.root=$SCRATCH/data", "run.profile=$SCRATCH"])
    assert (cfg.run.out_dir, cfg.data.path, cfg.data.root) == (f"{tmp_path}/runs/a", f"{tmp_path}/d.npz",
                                                              f"{tmp_path}/data")  # fmt: skip
    assert cfg.run.profile == "$SCRATCH"  # (no path: as typed, and refused as no A:B where it is used)
    for typed in ("$DDP_CIFAR_UNSET/runs/a", "/x/${DDP_CIFAR_UNSET}"):
        name = re.search(r"\$\{?\w+\}?", typed)[0]
        said = f"run.resume={typed}: the environment variable {name} is not set; set it, or write the path out"
        with pytest.raises(UsageError, match=f"^{re.escape(said)}$"):
            config.load(None, [f"run.resume={typed}"])
    assert config.load(None, ["run.out_dir=/a/$/b$"]).run.out_dir == "/a/$/b$"  # a $ that names nothing stays
    saved = {"run": {"out_dir": "$DDP_CIFAR_UNSET/runs/a"}}  # a checkpoint's config (evaluate): read as it was saved
    assert config.from_dict(saved).run.out_dir == "$DDP_CIFAR_UNSET/runs/a"


def test_a_path_that_starts_with_a_tilde_is_in_the_home_directory(tmp_path, monkeypatch):
    """bash expands ~ in `--config ~/x.yaml` but not in `run.out_dir=~/runs/x` or `--out=~/c` (not an assignment
    to a shell variable), nor does YAML: the run went into a directory named "~" under the current one, which
    a later `rm -rf ~` to clean up would mistake for the home directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.yaml").write_text("run:\n  out_dir: ~/from-yaml\ndata:\n  root: ~/data\n")
    cfg = config.load("~/x.yaml", ["data.path=~/d.npz", "run.resume=~/last.pt"])
    assert (cfg.run.out_dir, cfg.data.root) == (f"{tmp_path}/from-yaml", f"{tmp_path}/data")
    assert (cfg.data.path, cfg.run.resume) == (f"{tmp_path}/d.npz", f"{tmp_path}/last.pt")
    assert config.load(None, ["run.out_dir=~/runs/x", "run.profile=~"]).run.profile == "~"  # only paths
    assert config.load(None, ["run.out_dir=~/runs/x"]).run.out_dir == f"{tmp_path}/runs/x"
    assert cli.parse(["--out=~/c"], "usage", [cli.Option("--out", "DIR")])[0]["out"] == f"{tmp_path}/c"


def test_round_trip_through_a_dict():
    cfg = config.load(None, ["optim.lr=0.3", "model.name=tutorial"])
    assert config.from_dict(config.to_dict(cfg)) == cfg


CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_recipe_loads_and_says_how_to_run_it(path):
    config.load(str(path))
    header = path.read_text().split("\n\n")[0]
    assert header.startswith("# "), "a recipe opens with a comment"
    assert any(cmd in header for cmd in ("make train", "ddp/train.py", "launch/")), "...giving its command"
    assert "reach" in header.lower(), "...and what it should reach"


def test_there_are_recipes():
    assert {"quick.yaml", "tutorial.yaml", "resnet18.yaml", "smoke.yaml"} <= {p.name for p in CONFIGS}


def test_print_config_shows_the_resolved_values_as_a_script():
    out = ok(python(str(TRAIN), "--config", "configs/quick.yaml", "optim.lr=0.25", "--print-config")).stdout
    cfg = config.from_dict(yaml.safe_load(out))
    assert cfg.optim.lr == 0.25 and cfg.model.name == "fast" and cfg.model.width == 0.25


def test_help_lists_every_key_as_a_module():
    out = ok(python("-m", "ddp.train", "--help")).stdout
    for key in ("data.dataset", "train.batch_size", "optim.lr", "run.parallel", "run.amp", "run.channels_last"):
        assert key in out


def test_a_setting_the_run_never_reads_is_a_note_naming_why_and_a_recipe_gets_none():
    """A value given to a setting that nothing reads in this run is said once, with why: data.path without
    data.dataset=npz (it trained on CIFAR-10, downloaded, silently), a method's setting with the method off. Not for
    the default value (an ablation keeps its recipe's), nor for any recipe in configs/ as it is."""
    from ddp import checks

    said = []
    overrides = ["data.path=mine.npz", "data.augment=false", "data.pad=reflect", "data.flip=alternate",
                 "data.translate=4", "optim.muon_momentum=0.9", "train.lookahead_decay=0.5", "optim.name=adamw",
                 "optim.nesterov=false", "optim.schedule=constant", "optim.final_lr=0.1", "model.whiten=false",
                 "optim.whiten_bias_epochs=5", "data.mix_prob=0.5", "train.ema_warmup=3"]  # fmt: skip
    notes = checks.unused(config.load(None, overrides), said.append)
    assert said == [f"note: {n}" for n in notes]
    assert notes == [
        "data.path=mine.npz does nothing here: data.dataset=cifar10 (data.dataset=npz's file)",
        "data.pad=reflect, data.flip=alternate do nothing here: data.augment=false",  # translate=4: the default's
        "data.mix_prob=0.5 does nothing here: MixUp and CutMix are off (data.mixup_alpha=0, data.cutmix_alpha=0)",
        "train.ema_warmup=3 does nothing here: the moving average is off (train.ema_decay=0)",
        "train.lookahead_decay=0.5 does nothing here: lookahead is off (train.lookahead_every=0)",
        "optim.nesterov=false does nothing here: optim.name=adamw (SGD's settings)",
        "optim.muon_momentum=0.9 does nothing here: Muon is off (optim.muon_lr=0)",
        "optim.final_lr=0.1 does nothing here: optim.schedule=constant",
        "optim.whiten_bias_epochs=5 does nothing here: model.whiten=false",
    ]
    used = ["data.dataset=npz", "data.path=mine.npz", "data.pad=reflect", "optim.muon_lr=0.1",
            "optim.muon_momentum=0.9", "data.cutmix_alpha=1", "data.mix_prob=0.5", "optim.warmup_epochs=0",
            "optim.warmup_from=0"]  # fmt: skip
    assert checks.unused(config.load(None, used)) == []
    synthetic = ["data.dataset=synthetic", "data.root=/scratch", "data.download=false", "optim.warmup_epochs=0",
                 "optim.warmup_from=0.2"]  # fmt: skip
    assert checks.unused(config.load(None, synthetic)) == [
        "data.root=/scratch, data.download=false do nothing here: data.dataset=synthetic (CIFAR's settings)",
        "optim.warmup_from=0.2 does nothing here: no warm-up (optim.warmup_epochs=0)",
    ]
    assert checks.unused(config.load(None, ["data.dataset=npz", "data.synthetic_train=100"])) == [
        "data.synthetic_train=100 does nothing here: data.dataset=npz"
    ]
    for recipe in CONFIGS:
        assert checks.unused(config.load(str(recipe), [])) == [], recipe.name
    checkpoints = config.load(None, ["data.path=x.npz", "train.ema_warmup=3"])  # evaluate: the keys it was given only
    assert checks.unused(checkpoints, typed=[]) == [] and len(checks.unused(checkpoints, typed=["data.path"])) == 1
