"""OpenRLHF's weighted prompt files and several reward services: `--prompt_data a,b --prompt_data_probs 0.7,0.3`
(data.train_files_probs: the files blended as HF datasets' interleave_datasets blends them, all_exhausted) and
`--remote_rm_url URL1,URL2` (services.reward_url: each batch sharded over the services, in row order)."""

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler

import pytest

from alignrl.compat import openrlhf_dotted as D
from alignrl.compat import openrlhf_flags as F
from alignrl.compat import openrlhf_keys as K
from alignrl.compat import openrlhf_sources as S
from alignrl.config import ConfigError, load_config
from alignrl.data.blend import blend_order
from alignrl.data.loaders import load_blended, load_samples
from alignrl.data.prompts import load_task_data
from alignrl.rollout.remote import ServiceError
from alignrl.rollout.remote_reward import RemoteReward
from alignrl.rollout.service_health import check_services
from alignrl.runtime.ports import free_port

pytestmark = pytest.mark.timeout(300)

BASE = ["--actor_num_gpus_per_node", "8", "--ref_num_gpus_per_node", "8", "--vllm_num_engines", "8",
        "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--rollout_batch_size", "128",
        "--train_batch_size", "128", "--micro_train_batch_size", "2"]
KEYS = ["data.prompt_key=prompt", "data.label_key=label", "data.val_files=synthetic", "data.val_size=4"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two prompt files by column: a.jsonl of 600 rows, b.jsonl of 200 (a prompt names its file and row)."""
    folder = tmp_path_factory.mktemp("blend")
    out = []
    for name, rows in (("a", 600), ("b", 200)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"{name}{i}: what is {i}+1?", "label": str(i + 1)}) + "\n"
                                for i in range(rows)))
        out.append(str(path))
    return out


def names(samples) -> list[str]:
    return [s.messages[-1]["content"].split(":")[0] for s in samples]


def train_rows(files, *extra):
    cfg = load_config(None, [f"data.train_files={json.dumps(files)}", *KEYS, *extra])
    return load_task_data(cfg)[0]


def test_weights_blend_the_files_by_seed(files):
    """0.75/0.25 over 600 and 200 rows: about those shares, every row of each file at least once, the same order
    for a seed and another for another seed; no weights: the concatenation, row for row."""
    rows = names(train_rows(files, "data.train_files_probs=[0.75,0.25]", "trainer.seed=3"))
    share = Counter(r[0] for r in rows)["a"] / len(rows)
    assert 0.65 < share < 0.85, share
    assert {f"a{i}" for i in range(600)} <= set(rows) and {f"b{i}" for i in range(200)} <= set(rows)
    assert rows == names(train_rows(files, "data.train_files_probs=[0.75,0.25]", "trainer.seed=3"))
    assert rows != names(train_rows(files, "data.train_files_probs=[0.75,0.25]", "trainer.seed=4"))
    plain = train_rows(files)
    assert plain == load_samples(files, prompt_key="prompt", label_key="label")
    assert names(plain) == [f"a{i}" for i in range(600)] + [f"b{i}" for i in range(200)]


def test_blend_order_is_interleave_datasets_all_exhausted():
    """The rule: a draw takes its file's next row; a file that runs out starts over; the blend ends at the draw that
    uses the last file's last unused row. Weights that do not sum to 1 are taken as shares."""
    lengths = (3, 20)
    for seed in range(5):
        order, seen, ran_out = blend_order(lengths, [0.5, 0.5], seed), [0, 0], []
        for i, (f, row) in enumerate(order):
            assert row == seen[f] % lengths[f]
            seen[f] += 1
            if seen[f] == lengths[f]:
                ran_out.append(i)
        assert len(ran_out) == 2 and ran_out[-1] == len(order) - 1
    assert blend_order([40, 40], [3, 1], 5) == blend_order([40, 40], [0.75, 0.25], 5)


def test_max_samples_caps_each_file_then_the_blend(files):
    """OpenRLHF's --max_samples around its blend: each file's first N rows, blended, then the blend's first N."""
    rows = train_rows(files, "data.train_files_probs=[0.5,0.5]", "data.train_max_samples=50", "trainer.seed=1")
    assert len(rows) == 50 and all(int(n[1:]) < 50 for n in names(rows))
    capped = load_blended(files, [0.5, 0.5], 1, limit=50, prompt_key="prompt", label_key="label")
    assert rows == capped


@pytest.mark.parametrize("probs,why", [("[0.7]", r"has 1 weight\(s\) for 2 data.train_files"),
                                       ("[0.7,0.2,0.1]", r"has 3 weight\(s\) for 2 data.train_files"),
                                       ("[0.7,0]", "0 is not a finite number above 0"),
                                       ("[0.7,-0.3]", "-0.3 is not a finite number above 0"),
                                       ("[0.7,.inf]", "inf is not a finite number above 0"),
                                       ("[0.7,x]", "'x' is not a finite number above 0")])
def test_bad_weights_are_one_line(files, probs, why):
    with pytest.raises(ConfigError, match=why) as e:
        load_config(None, [f"data.train_files={json.dumps(files)}", f"data.train_files_probs={probs}"])
    assert "\n" not in str(e.value) and "data.train_files_probs" in str(e.value)


def config(argv):
    args = F.parser().parse_args(D.to_underscore(argv))
    F.check(args)
    return args, load_config(None, K.overrides(args, False, 3))


def test_openrlhf_flags_map_and_blend(files):
    """--prompt_data_probs as data.train_files_probs (no 'not applied' line), seeded by --seed, capped by
    --max_samples; bad values are one line in flag terms; one file takes no weights."""
    argv = BASE + ["--prompt_data", ",".join(files), "--input_key", "prompt", "--label_key", "label"]
    args, cfg = config(argv + ["--prompt_data_probs", "0.75,0.25", "--seed", "7", "--max_samples", "100"])
    assert (cfg.data.train_files_probs, cfg.data.train_max_samples, cfg.trainer.seed) == ([0.75, 0.25], 100, 7)
    assert not any("prompt_data_probs" in line for line in K.unused_here(args, False))
    rows = load_task_data(cfg)[0]
    assert len(rows) == 100 and names(rows) == names(load_blended(files, [0.75, 0.25], 7, limit=100,
                                                                  prompt_key="prompt", label_key="label"))
    assert S.prompt_rows(args) == 100
    blended = config(argv + ["--prompt_data_probs", "0.75,0.25", "--seed", "7"])
    assert S.prompt_rows(blended[0]) == len(load_task_data(blended[1])[0]) > 800  # the blend repeats b's rows
    assert S.prompt_rows(config(argv)[0]) == 800
    assert config(argv + ["--data.prompt_probs", "0.75,0.25"])[1].data.train_files_probs == [0.75, 0.25]
    assert config(argv)[1].data.train_files_probs == []
    one = BASE + ["--prompt_data", files[0], "--input_key", "prompt", "--label_key", "label"]
    assert config(one + ["--prompt_data_probs", "0.5"])[1].data.train_files_probs == []
    for bad, why in (("0.7,abc", "give numbers separated by commas"), ("0.7,0", "a finite number above 0"),
                     ("0.2,0.3,0.5", "3 probabilities for 2 --prompt_data files")):
        with pytest.raises(ConfigError, match=why) as e:
            config(argv + ["--prompt_data_probs", bad])
        assert "\n" not in str(e.value) and str(e.value).startswith(f"--prompt_data_probs {bad}:")


class Recorded:
    """An OpenRLHF-style reward server (/get_reward) and an `alignrl serve reward` one (/v1/score) in one stub:
    each request's rows are recorded; a reward is the row's label (or response) as a number."""

    def __init__(self, barrier: threading.Barrier | None = None):
        self.bodies, self.health, self.barrier = [], 0, barrier

    def handler(self):
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                rec.health += 1
                self._reply({"status": "healthy"})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                rec.bodies.append(body)
                if rec.barrier is not None:  # both shards in flight at once, or this wait breaks
                    rec.barrier.wait()
                if self.path == "/get_reward":
                    self._reply({"rewards": [float(x) for x in body["labels"]]})
                else:
                    self._reply({"scores": [float(len(r)) for r in body["responses"]]})

            def log_message(self, *args):
                pass

        return Handler


def test_several_reward_urls_shard_each_batch_in_order(http_servers):
    """Seven rows over two services, two rows a request: the first service gets rows 0-3, the second 4-6, and the
    rewards come back in row order, for OpenRLHF's protocol and alignrl's."""
    a, b = Recorded(), Recorded()
    urls = [http_servers(a.handler()), http_servers(b.handler())]
    reward = RemoteReward(",".join(u + "/get_reward" for u in urls), max_rows=2, retries=1)
    labels = [str(i) for i in range(7)]
    assert reward.score_texts([f"p{i}" for i in range(7)], ["r"] * 7, labels) == [float(i) for i in range(7)]
    assert [x["labels"] for x in a.bodies] == [["0", "1"], ["2", "3"]]
    assert [x["labels"] for x in b.bodies] == [["4", "5"], ["6"]]
    assert b.bodies[0]["query"] == ["p4r", "p5r"] and b.bodies[0]["prompts"] == ["p4", "p5"]
    reward.close()
    a.bodies.clear()
    b.bodies.clear()
    scorer = RemoteReward(",".join(urls), retries=1)  # alignrl serve reward's /v1/score, the token-id rows
    assert scorer.score_texts(["x"] * 3, ["a", "bb", "ccc"]) == [1.0, 2.0, 3.0]
    assert [x["responses"] for x in a.bodies] == [["a", "bb"]] and [x["responses"] for x in b.bodies] == [["ccc"]]
    assert scorer.score_texts(["x"], ["abcd"]) == [4.0] and len(b.bodies) == 1  # one row: the first service only
    scorer.close()


def test_the_shards_are_posted_together(http_servers):
    """Each service holds its request until the other's has arrived: posted one after the other, they never would."""
    barrier = threading.Barrier(2, timeout=120)
    a, b = Recorded(barrier), Recorded(barrier)
    reward = RemoteReward(f"{http_servers(a.handler())}/get_reward,{http_servers(b.handler())}/get_reward",
                          retries=1)
    assert reward.score_texts(["p"] * 4, ["r"] * 4, ["1", "2", "3", "4"]) == [1.0, 2.0, 3.0, 4.0]
    assert not barrier.broken
    reward.close()


def test_a_dead_reward_url_is_named_in_one_line(http_servers):
    """The second of two services down: scoring and the start-up check each stop in one line naming it; both up,
    the check asks each service's /health."""
    live = Recorded()
    up = http_servers(live.handler())
    dead = f"http://127.0.0.1:{free_port()}"
    reward = RemoteReward(f"{up}/get_reward,{dead}/get_reward", retries=1, backoff=0.0)
    with pytest.raises(ServiceError) as e:
        reward.score_texts(["p"] * 4, ["r"] * 4, ["1"] * 4)
    assert str(e.value).startswith(f"reward service at {dead} is not reachable after 1 tries")
    assert "\n" not in str(e.value) and len(live.bodies) == 1
    reward.close()
    argv = [f"services.reward_url={up}/get_reward,{dead}/get_reward", "services.retries=1", "services.wait_s=0"]
    with pytest.raises(ServiceError) as e:
        check_services(load_config(None, argv), wait_s=0)
    assert str(e.value).startswith(f"reward service at {dead} is not reachable") and "\n" not in str(e.value)
    other, live.health = Recorded(), 0
    both = f"{up},{http_servers(other.handler())}"
    check_services(load_config(None, [f"services.reward_url={both}", "services.wait_s=0"]), wait_s=0)
    assert live.health == 1 and other.health == 1


def test_reward_urls_from_the_command_line(tmp_path):
    """--remote_rm_url URL1,URL2 is services.reward_url, which the reward client shards over; URLs of two kinds, or a
    part that is no URL, are one line."""
    urls = "http://127.0.0.1:5000/get_reward, http://127.0.0.1:5001/get_reward"
    cfg = config(BASE + ["--remote_rm_url", urls])[1]
    assert cfg.services.reward_url == urls.replace(" ", "")
    reward = RemoteReward(cfg.services.reward_url)
    assert [c.url for c in reward.clients] == ["http://127.0.0.1:5000", "http://127.0.0.1:5001"]
    assert reward.paths == ["/get_reward", "/get_reward"] and reward.takes_labels
    reward.close()
    with pytest.raises(ServiceError, match="mix `alignrl serve reward` services") as e:
        RemoteReward("http://127.0.0.1:5000/get_reward,http://127.0.0.1:8002")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="'127.0.0.1:5001' is not a reward service URL") as e:
        config(BASE + ["--remote_rm_url", "http://127.0.0.1:5000/get_reward,127.0.0.1:5001"])
    assert "\n" not in str(e.value)


def test_each_reward_url_of_a_list_is_checked_at_load():
    from alignrl.config import ConfigError, load_config

    cfg = load_config(None, ["services.reward_url=http://127.0.0.1:5001,http://127.0.0.1:5002/get_reward"])
    assert cfg.services.reward_url.count(",") == 1
    with pytest.raises(ConfigError, match="services.reward_url='127.0.0.1:5002'"):
        load_config(None, ["services.reward_url=http://127.0.0.1:5001,127.0.0.1:5002"])
