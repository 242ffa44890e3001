"""verl's custom dataset classes (data.custom_cls -> data.dataset_class): the class makes the rows from the data files
(verl's RLHFDataset provided where verl is not installed), the epochs are counted in them, a run trains on them, and
what alignrl cannot use is one line."""

import json
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignrl.config import load_config
from alignrl.config.schema import ConfigError
from alignrl.data.loaders import DataError
from alignrl.data.prompts import load_task_data

# ReTool's pattern: raw competition rows (Problem/Answer) mapped to verl's layout in _read_files_and_tokenize
MAPPING_CLASS = textwrap.dedent('''
    import pyarrow.parquet as pq
    from verl.utils.dataset import RLHFDataset

    answer_format = "\\nWrite the final answer after ####."

    class CustomRLHFDataset(RLHFDataset):
        def _read_files_and_tokenize(self):
            rows = []
            for path in self.data_files:
                rows += [self.map_fn(r, data_source="gsm8k") for r in pq.read_table(path).to_pylist()]
            self.dataframe = rows

        def map_fn(self, row, *, data_source=None):
            return {"data_source": data_source, "prompt": [{"role": "user", "content": row["Problem"] + answer_format}],
                    "ability": "MATH", "reward_model": {"ground_truth": str(row["Answer"])},
                    "agent_name": "tool_agent", "extra_info": {"max_prompt_length": self.max_prompt_length}}
''')


def _raw(path, n):
    pq.write_table(pa.Table.from_pylist([{"Problem": f"What is {i} + {i}?", "Answer": 2 * i} for i in range(n)]),
                   path)


@pytest.fixture
def retool_like(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "retool.py").write_text(MAPPING_CLASS)
    _raw(tmp_path / "train.parquet", 6)
    _raw(tmp_path / "test.parquet", 2)
    return tmp_path


def test_verls_custom_cls_makes_the_rows_and_counts_the_epochs(retool_like):
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "data.train_files=train.parquet",
                             "data.val_files=test.parquet", "data.custom_cls.path=recipe/retool.py",
                             "data.custom_cls.name=CustomRLHFDataset", "data.train_batch_size=2",
                             "data.max_prompt_length=77", "trainer.total_epochs=2",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    assert cfg.data.dataset_class == "recipe/retool.py:CustomRLHFDataset"
    assert cfg.trainer.total_training_steps == 6  # 6 rows the class made, 2 a step, 2 epochs
    train, val = load_task_data(cfg)
    assert [len(train), len(val)] == [6, 2]
    assert train[3].messages == [{"role": "user", "content": "What is 3 + 3?\nWrite the final answer after ####."}]
    assert (train[3].ground_truth, train[3].data_source) == ("6", "gsm8k")
    assert train[3].extra["max_prompt_length"] == 77  # the class read verl's data config
    assert "through recipe/retool.py:CustomRLHFDataset" in train[0].source


def test_a_class_that_keeps_verls_reading_gets_the_files_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain.py").write_text("from verl.utils.dataset.rl_dataset import RLHFDataset\n\n"
                                       "class Plain(RLHFDataset):\n    pass\n")
    rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"ground_truth": str(i)}} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    (tmp_path / "v.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    cfg = load_config(None, ["data.train_files=t.parquet", "data.val_files=v.jsonl",
                             "data.dataset_class=plain.py:Plain",
                             "data.val_size=1"])
    train, val = load_task_data(cfg)
    assert [s.ground_truth for s in train] == ["0", "1", "2", "3", "4"] and [s.ground_truth for s in val] == ["0"]


@pytest.mark.parametrize("body, spec, words", [
    ("class X:\n    pass\n", "d.py:X", "does not subclass verl's RLHFDataset"),
    ("from verl.utils.dataset import RLHFDataset\nclass X(RLHFDataset):\n    def __getitem__(self, i):\n"
     "        return {}\n", "d.py:X", "overrides __getitem__"),
    ("from verl.utils.dataset import RLHFDataset\nclass X(RLHFDataset):\n    def _read_files_and_tokenize(self):\n"
     "        raise KeyError('Problem')\n", "d.py:X", "failed on t.parquet: KeyError: 'Problem'"),
    ("from verl.utils.dataset import RLHFDataset\nclass X(RLHFDataset):\n    def _read_files_and_tokenize(self):\n"
     "        self.dataframe = 3\n", "d.py:X", "self.dataframe is a int"),
    ("from verl.utils.dataset import RLHFDataset\nclass X(RLHFDataset):\n    def _read_files_and_tokenize(self):\n"
     "        self.dataframe = [{'prompt': 'hi'}]\n", "d.py:X", "row 0: row is missing data_source, reward_model"),
    ("import no_such_package_xyz\n", "d.py:X", "failed to import: ModuleNotFoundError"),
    ("x = 1\n", "d.py:Y", "has no class 'Y'"),
    ("x = 1\n", "missing.py:Y", "file not found: missing.py"),
    ("x = 1\n", "d.py", "not of the form path/to/file.py:ClassName"),
])
def test_what_alignrl_cannot_use_is_one_line(tmp_path, monkeypatch, body, spec, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.py").write_text(body)
    pq.write_table(pa.Table.from_pylist([{"a": 1}]), tmp_path / "t.parquet")
    cfg = load_config(None, ["data.train_files=t.parquet", "data.val_files=t.parquet", f"data.dataset_class={spec}"])
    with pytest.raises(DataError, match=words) as err:
        load_task_data(cfg)
    assert "\n" not in str(err.value)


def test_a_path_without_a_class_name_is_one_line():
    with pytest.raises(ConfigError, match="data.custom_cls.path=x.py needs data.custom_cls.name"):
        load_config(None, ["algorithm.adv_estimator=grpo", "data.custom_cls.path=x.py"])
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "data.custom_cls.path=null", "data.custom_cls.name=null"])
    assert cfg.data.dataset_class == ""


def test_a_run_trains_on_the_rows_the_class_made(retool_like, tiny_model_dir, cli_in_process):
    got = cli_in_process(
        "train", "ppo", "algorithm.adv_estimator=grpo", "data.train_files=train.parquet", "data.val_files=test.parquet",
        "data.custom_cls.path=recipe/retool.py", "data.custom_cls.name=CustomRLHFDataset", "data.train_batch_size=2",
        "data.max_prompt_length=64", "data.max_response_length=8", f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=2", "trainer.logger=['console','jsonl']", "trainer.total_epochs=1",
        "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.output_dir={retool_like / 'out'}", f"trainer.default_local_dir={retool_like / 'ckpt'}",
        "trainer.progress_bar=false")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(line) for line in next((retool_like / "out").glob("*/logs/metrics.jsonl")).read_text()
            .splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]


def test_verls_reading_goes_through_the_datasets_package_where_it_is_installed(tmp_path, monkeypatch):
    """verl's RLHFDataset leaves a datasets.Dataset in self.dataframe, which a subclass may map further: alignrl's does
    too where the package is installed (a stand-in module here, recording what it was asked)."""
    import sys
    import types

    asked = []

    class Frame(list):
        def select(self, keep):
            return Frame(self[i] for i in keep)

        def to_list(self):
            return list(self)

        def map(self, fn):
            return Frame(fn(dict(r)) for r in self)

    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda kind, data_files: asked.append((kind, data_files)) or {
        "train": Frame(pq.read_table(data_files).to_pylist())}
    fake.concatenate_datasets = lambda parts: Frame(r for p in parts for r in p)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mapped.py").write_text(
        "from verl.utils.dataset import RLHFDataset\n\nclass Mapped(RLHFDataset):\n"
        "    def _read_files_and_tokenize(self):\n        super()._read_files_and_tokenize()\n"
        "        self.dataframe = self.dataframe.map(lambda r: dict(r, data_source='gsm8k'))\n")
    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"ground_truth": str(i)}} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    cfg = load_config(None, ["data.train_files=t.parquet", "data.val_files=t.parquet",
                             "data.dataset_class=mapped.py:Mapped", "data.val_size=2"])
    train, val = load_task_data(cfg)
    assert [(s.data_source, s.ground_truth) for s in train] == [("gsm8k", str(i)) for i in range(4)]
    assert len(val) == 2 and asked[0] == ("parquet", "t.parquet")
