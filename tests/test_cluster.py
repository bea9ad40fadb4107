"""Cluster specs, task names and how a process finds its cluster and task."""

from __future__ import annotations

import json

import pytest

from zmqflow.cluster import Address, ClusterSpec, TaskId, load_config, resolve
from zmqflow.errors import ConfigError

PLAIN = {"ps": ["127.0.0.1:2224"], "worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}
TF_SHAPED = {"cluster": PLAIN, "task": {"type": "worker", "index": 1}, "environment": "cloud"}
OTHER = {"worker": ["10.0.0.1:3000", "10.0.0.2:3000", "10.0.0.3:3000"]}


def config_error(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kw)
    return str(info.value)


# ClusterSpec -------------------------------------------------------------------------------


def test_plain_shape():
    spec = ClusterSpec(PLAIN)
    assert spec.jobs == ["ps", "worker"]
    assert spec.tasks == [TaskId("ps", 0), TaskId("worker", 0), TaskId("worker", 1)]
    assert list(spec) == spec.tasks and len(spec) == 3
    assert spec.num_tasks("worker") == 2 and spec.num_tasks("chief") == 0
    assert spec.task_indices("worker") == [0, 1]
    assert spec.address("worker:1") == Address("tcp", host="127.0.0.1", port=2223)
    assert spec.address(TaskId("ps", 0)).endpoint == "tcp://127.0.0.1:2224"
    assert "worker:1" in spec and TaskId("ps", 0) in spec
    assert "worker:2" not in spec and "chief:0" not in spec and "nonsense" not in spec and 5 not in spec
    assert spec.describe() == "ps: 1, worker: 2"


def test_tf_config_shape_ignores_task_and_environment():
    spec = ClusterSpec(TF_SHAPED)
    assert spec == ClusterSpec(PLAIN)
    assert spec.as_dict() == PLAIN


def test_copy_constructor_and_equality():
    spec = ClusterSpec(PLAIN)
    copy = ClusterSpec(spec)
    assert copy == spec and hash(copy) == hash(spec) and copy is not spec
    assert ClusterSpec(OTHER) != spec
    assert spec != PLAIN


def test_sparse_index_maps():
    spec = ClusterSpec({"worker": {"0": "h0:1", "2": "h2:1"}, "ps": {1: "p1:1"}})
    assert spec.task_indices("worker") == [0, 2] and spec.task_indices("ps") == [1]
    assert "worker:1" not in spec and "worker:2" in spec
    assert spec.address("worker:2") == Address("tcp", host="h2", port=1)
    assert spec.as_dict() == {"worker": {"0": "h0:1", "2": "h2:1"}, "ps": {"1": "p1:1"}}
    assert ClusterSpec.from_json(spec.to_json()) == spec


def test_dense_index_map_is_written_as_a_list():
    spec = ClusterSpec({"worker": {"1": "h1:1", "0": "h0:1"}})
    assert spec.as_dict() == {"worker": ["h0:1", "h1:1"]}


@pytest.mark.parametrize("job", ["chief", "evaluator", "trainer", "Reader_2", "embed-shard", "x"])
def test_any_job_name(job):
    spec = ClusterSpec({job: ["localhost:2000"]})
    assert spec.jobs == [job] and TaskId(job, 0) in spec


def test_jobs_named_cluster_and_task_in_the_plain_shape():
    spec = ClusterSpec({"cluster": ["h:1"], "task": ["h:2"]})
    assert spec.jobs == ["cluster", "task"]
    loaded, task = load_config({"cluster": ["h:1"], "task": ["h:2"]})
    assert loaded == spec and task is None


def test_as_dict_and_to_json_round_trip():
    data = {"ps": ["[::1]:2224", "ipc:///tmp/zf-ps1"], "worker": ["inproc://w0", "localhost:2222"]}
    spec = ClusterSpec(data)
    assert spec.as_dict() == data
    assert json.loads(spec.to_json()) == data
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert ClusterSpec(spec.as_dict()) == spec
    assert repr(spec) == f"ClusterSpec({data!r})"


def test_from_file_both_shapes(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(PLAIN))
    tf = tmp_path / "tf.json"
    tf.write_text(json.dumps(TF_SHAPED))
    assert ClusterSpec.from_file(plain) == ClusterSpec(PLAIN)
    assert ClusterSpec.from_file(str(tf)) == ClusterSpec(PLAIN)


def test_from_json():
    assert ClusterSpec.from_json(json.dumps(PLAIN)) == ClusterSpec(PLAIN)
    assert ClusterSpec.from_json(json.dumps(TF_SHAPED)) == ClusterSpec(PLAIN)


def test_task_at_finds_either_form():
    spec = ClusterSpec(PLAIN)
    assert spec.task_at("tcp://127.0.0.1:2223") == TaskId("worker", 1)
    assert spec.task_at("127.0.0.1:2224") == TaskId("ps", 0)
    assert spec.task_at("127.0.0.1:9999") is None


# addresses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, scheme, host, port, path, endpoint",
    [
        ("127.0.0.1:2222", "tcp", "127.0.0.1", 2222, "", "tcp://127.0.0.1:2222"),
        ("tcp://host-1.example.com:80", "tcp", "host-1.example.com", 80, "", "tcp://host-1.example.com:80"),
        ("  localhost:65535 ", "tcp", "localhost", 65535, "", "tcp://localhost:65535"),
        ("[::1]:2222", "tcp", "::1", 2222, "", "tcp://[::1]:2222"),
        ("[fe80::1]:1", "tcp", "fe80::1", 1, "", "tcp://[fe80::1]:1"),
        ("*:5555", "tcp", "*", 5555, "", "tcp://*:5555"),
        ("ipc:///tmp/zf.sock", "ipc", "", 0, "/tmp/zf.sock", "ipc:///tmp/zf.sock"),
        ("ipc://@abstract", "ipc", "", 0, "@abstract", "ipc://@abstract"),
        ("inproc://worker-0", "inproc", "", 0, "worker-0", "inproc://worker-0"),
    ],
)
def test_address_forms(text, scheme, host, port, path, endpoint):
    addr = Address.parse(text)
    assert (addr.scheme, addr.host, addr.port, addr.path) == (scheme, host, port, path)
    assert addr.endpoint == endpoint
    assert Address.parse(str(addr)) == addr


def test_ipv6_str_and_bind_endpoint():
    addr = Address.parse("[::1]:2222")
    assert str(addr) == "[::1]:2222"
    assert addr.bind_endpoint() == "tcp://[::1]:2222"
    assert Address.parse("127.0.0.1:7").bind_endpoint() == "tcp://127.0.0.1:7"
    assert Address.parse("inproc://x").bind_endpoint() == "inproc://x"
    assert Address.parse("0.0.0.0:7").bind_endpoint() == "tcp://0.0.0.0:7"


def test_same_address_written_two_ways_is_a_duplicate():
    msg = config_error(ClusterSpec, {"ps": ["127.0.0.1:2222"], "worker": ["tcp://127.0.0.1:2222"]})
    assert "duplicate address 127.0.0.1:2222" in msg


# TaskId ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["worker:0", "/job:worker/task:0", "/job:worker/replica:0/task:0", "/job:worker/replica:3/task:0/device:CPU:0",
     " worker:0 ", TaskId("worker", 0)],
)
def test_task_forms(text):
    assert TaskId.parse(text) == TaskId("worker", 0)


def test_task_str_device_order_and_hash():
    tid = TaskId.parse("/job:ps/task:12")
    assert tid == TaskId("ps", 12) and tid.job == "ps" and tid.index == 12
    assert str(tid) == "ps:12" and tid.device == "/job:ps/task:12"
    assert TaskId.parse(str(tid)) == tid == TaskId.parse(tid.device)
    assert TaskId("ps", 1) != TaskId("ps", 2) and TaskId("ps", 1) != TaskId("worker", 1)
    assert sorted([TaskId("worker", 1), TaskId("ps", 3), TaskId("worker", 0)]) == [
        TaskId("ps", 3), TaskId("worker", 0), TaskId("worker", 1)
    ]
    assert len({TaskId("ps", 0), TaskId.parse("ps:0"), TaskId.parse("/job:ps/task:0")}) == 1


def test_a_task_parsed_twice_is_one_instance_and_the_record_is_bounded():
    """So that the dicts keyed by task match by identity; the record of strings stays bounded."""
    from zmqflow import task_id

    assert TaskId.parse("ps:7") is TaskId.parse("ps:7") and TaskId.parse("/job:ps/task:7") == TaskId.parse("ps:7")
    for i in range(task_id._PARSED_MAX + 10):
        assert TaskId.parse(f"worker:{i}") == TaskId("worker", i)
        assert len(task_id._PARSED) <= task_id._PARSED_MAX
    with pytest.raises(ConfigError):
        TaskId.parse("ps:x")
    assert "ps:x" not in task_id._PARSED


def test_a_tasks_kept_hash_is_its_fields_and_is_made_anew_where_it_is_unpickled():
    import os
    import pickle
    import subprocess
    import sys

    task = TaskId("ps", 3)
    assert hash(task) == hash(("ps", 3)) and pickle.loads(pickle.dumps(task)) == task
    assert repr(task) == "TaskId(job='ps', index=3)" and TaskId("ps", 3) < TaskId("ps", 4)
    code = ("import pickle, sys; t = pickle.loads(sys.stdin.buffer.read()); "
            "print(hash(t) == hash(('ps', 3)) and {t: 1}.get(type(t)('ps', 3)) == 1)")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another process, another string hash
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(task), capture_output=True, timeout=60,
                         env=env, check=True).stdout
    assert out.strip() == b"True"


@pytest.mark.parametrize(
    "value",
    ["worker", "worker:", ":0", "0worker:0", "worker:-1", "worker:0:1", "worker:x", "/job:worker", "/job:worker/task:",
     "/task:0", "worker:\u0661", "", 5, None, ("worker", 0)],
)
def test_malformed_task(value):
    msg = config_error(TaskId.parse, value)
    assert "malformed task" in msg and repr(value) in msg


# every ConfigError names what is at fault ---------------------------------------------------


def test_duplicate_address_names_both_tasks():
    msg = config_error(ClusterSpec, {"ps": ["h:1"], "worker": ["h:2", "h:1"]})
    assert "duplicate address h:1" in msg
    assert "job 'worker' index 1" in msg and "job 'ps' index 0" in msg


def test_duplicate_address_within_a_job():
    msg = config_error(ClusterSpec, {"worker": ["h:1", "h:1"]})
    assert "job 'worker' index 1" in msg and "job 'worker' index 0" in msg


def test_unknown_task():
    spec = ClusterSpec(PLAIN)
    msg = config_error(spec.address, "worker:5")
    assert "unknown task worker:5" in msg and "job 'worker' index 5" in msg and "worker: 2" in msg
    msg = config_error(spec.address, "chief:0")
    assert "job 'chief' index 0" in msg


@pytest.mark.parametrize(
    "value, fault",
    [
        ("nohost", "malformed address 'nohost'"),
        ("h:", "malformed port ''"),
        (":80", "malformed host ''"),
        ("bad host:1", "malformed host 'bad host'"),
        ("under_score:1", "malformed host 'under_score'"),
        ("[::1]2222", "malformed address '[::1]2222'"),
        ("[::1", "malformed address '[::1'"),
        ("udp://h:1", "unsupported scheme 'udp'"),
        ("ipc://", "empty ipc path"),
        ("inproc://", "empty inproc path"),
        ("", "expected an address string"),
        ("   ", "expected an address string"),
        (2222, "expected an address string"),
        (None, "expected an address string"),
    ],
)
def test_malformed_address(value, fault):
    msg = config_error(ClusterSpec, {"ps": ["h0:1"], "worker": ["h1:1", value]})
    assert "job 'worker' index 1" in msg and fault in msg


@pytest.mark.parametrize("port", ["http", "80a", "-1", "1.5", "\u00b2", "\u0661\u0662", " 1"])
def test_bad_port_text(port):
    msg = config_error(ClusterSpec, {"ps": [f"h:{port}"]})
    assert "job 'ps' index 0" in msg and f"malformed port {port!r}" in msg and f"'h:{port}'" in msg


@pytest.mark.parametrize("port", [0, 65536, 99999])
def test_port_out_of_range(port):
    msg = config_error(ClusterSpec, {"worker": {"3": f"h:{port}"}})
    assert "job 'worker' index 3" in msg and f"port {port} out of range 1..65535" in msg and f"'h:{port}'" in msg


def test_port_range_edges_are_accepted():
    spec = ClusterSpec({"w": ["h:1", "h:65535"]})
    assert [spec.address(t).port for t in spec] == [1, 65535]


@pytest.mark.parametrize("job", ["", "1worker", "work er", "worker:0", "_x", "wörker", 3, None])
def test_bad_job_name(job):
    msg = config_error(ClusterSpec, {job: ["h:1"]})
    assert f"malformed job name {job!r}" in msg


@pytest.mark.parametrize("key", ["a", "-1", "1.0", "", " 1", "\u00b2", "\u0661", -1, True, 1.0, None])
def test_bad_index_key(key):
    msg = config_error(ClusterSpec, {"worker": {key: "h:1"}})
    assert "job 'worker'" in msg and f"task index {key!r}" in msg


def test_index_given_twice():
    msg = config_error(ClusterSpec, {"worker": {"1": "h:1", 1: "h:2"}})
    assert "job 'worker'" in msg and "task index 1 given twice" in msg


@pytest.mark.parametrize("spec", [{}, {"worker": []}, {"worker": [], "ps": {}}, {"cluster": {}}])
def test_empty_cluster(spec):
    assert "no tasks" in config_error(ClusterSpec, spec)


@pytest.mark.parametrize("spec", [["h:1"], "worker", None, 3])
def test_non_mapping_spec(spec):
    msg = config_error(ClusterSpec, spec)
    assert "must be a mapping" in msg and type(spec).__name__ in msg


def test_string_instead_of_list():
    msg = config_error(ClusterSpec, {"ps": "127.0.0.1:2224"})
    assert "job 'ps'" in msg and "the string '127.0.0.1:2224'" in msg


@pytest.mark.parametrize("tasks, name", [(5, "int"), (None, "NoneType"), ({"h:1"}, "set")])
def test_tasks_of_another_type(tasks, name):
    msg = config_error(ClusterSpec, {"ps": tasks})
    assert "job 'ps'" in msg and name in msg


@pytest.mark.parametrize("text", ["{", "", "{'ps': []}", '{"ps": ["h:1"],}'])
def test_bad_json(text):
    assert "cluster JSON is not valid JSON" in config_error(ClusterSpec.from_json, text)


def test_bad_json_file_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"ps": [')
    msg = config_error(ClusterSpec.from_file, path)
    assert str(path) in msg and "not valid JSON" in msg


def test_unreadable_file_names_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    msg = config_error(ClusterSpec.from_file, missing)
    assert f"cannot read cluster file {str(missing)!r}" in msg
    msg = config_error(ClusterSpec.from_file, tmp_path)  # a directory
    assert f"cannot read cluster file {str(tmp_path)!r}" in msg


def test_json_that_is_not_an_object(tmp_path):
    assert "must be a mapping of job -> addresses, got list" in config_error(ClusterSpec.from_json, '["h:1"]')
    path = tmp_path / "list.json"
    path.write_text('["h:1"]')
    assert "must be a JSON object, got list" in config_error(load_config, path)


# load_config and resolve -------------------------------------------------------------------


def test_load_config_sources(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(TF_SHAPED))
    expected = (ClusterSpec(PLAIN), TaskId("worker", 1))
    assert load_config(path) == expected
    assert load_config(str(path)) == expected
    assert load_config(json.dumps(TF_SHAPED)) == expected
    assert load_config("  " + json.dumps(PLAIN)) == (ClusterSpec(PLAIN), None)
    assert load_config(TF_SHAPED) == expected
    assert load_config(ClusterSpec(PLAIN)) == (ClusterSpec(PLAIN), None)


@pytest.mark.parametrize(
    "task, fault",
    [
        ("worker:1", "'task' must look like"),
        ({"index": 1}, "'task' must look like"),
        ({"type": "worker", "index": -1}, "index must be a non-negative integer, got -1"),
        ({"type": "worker", "index": "x"}, "got 'x'"),
        ({"type": "worker", "index": "\u00b2"}, "got '\u00b2'"),
        ({"type": "worker", "index": True}, "got True"),
        ({"type": "1worker", "index": 0}, "type must be a job name, got '1worker'"),
    ],
)
def test_malformed_tf_config_task(task, fault):
    assert fault in config_error(load_config, {"cluster": PLAIN, "task": task})


def test_tf_config_task_index_defaults_and_text():
    assert load_config({"cluster": PLAIN, "task": {"type": "ps"}})[1] == TaskId("ps", 0)
    assert load_config({"cluster": PLAIN, "task": {"type": "worker", "index": "1"}})[1] == TaskId("worker", 1)
    assert load_config({"cluster": PLAIN})[1] is None


def env_of(cluster=None, task=None, tf=None) -> dict[str, str]:
    env = {"HOME": "/nowhere"}
    if cluster is not None:
        env["ZMQFLOW_CLUSTER"] = cluster if isinstance(cluster, str) else json.dumps(cluster)
    if task is not None:
        env["ZMQFLOW_TASK"] = task
    if tf is not None:
        env["TF_CONFIG"] = tf if isinstance(tf, str) else json.dumps(tf)
    return env


TF_OTHER = {"cluster": OTHER, "task": {"type": "worker", "index": 2}}


def test_explicit_arguments_beat_the_environment():
    env = env_of(cluster=OTHER, task="worker:2", tf=TF_OTHER)
    assert resolve(PLAIN, "ps:0", env) == (ClusterSpec(PLAIN), TaskId("ps", 0))


def test_explicit_arguments_win_even_over_a_broken_environment():
    env = env_of(cluster="{broken", task="nonsense", tf="{broken")
    assert resolve(PLAIN, "ps:0", env) == (ClusterSpec(PLAIN), TaskId("ps", 0))


def test_zmqflow_variables_beat_tf_config():
    env = env_of(cluster=PLAIN, task="worker:1", tf=TF_OTHER)
    assert resolve(env=env) == (ClusterSpec(PLAIN), TaskId("worker", 1))


def test_tf_config_alone():
    assert resolve(env=env_of(tf=TF_OTHER)) == (ClusterSpec(OTHER), TaskId("worker", 2))


def test_each_value_falls_back_on_its_own():
    # cluster from the argument, task from ZMQFLOW_TASK
    assert resolve(PLAIN, env=env_of(task="ps:0", tf=TF_OTHER)) == (ClusterSpec(PLAIN), TaskId("ps", 0))
    # task from the argument, cluster from ZMQFLOW_CLUSTER
    assert resolve(task="worker:0", env=env_of(cluster=PLAIN, tf=TF_OTHER)) == (ClusterSpec(PLAIN), TaskId("worker", 0))
    # task from the argument, cluster from TF_CONFIG
    assert resolve(task="worker:0", env=env_of(tf=TF_OTHER)) == (ClusterSpec(OTHER), TaskId("worker", 0))


def test_zmqflow_cluster_as_path_and_as_inline_json(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(PLAIN))
    expected = (ClusterSpec(PLAIN), TaskId("worker", 0))
    assert resolve(env=env_of(cluster=str(path), task="worker:0")) == expected
    assert resolve(env=env_of(cluster=json.dumps(PLAIN), task="worker:0")) == expected
    assert resolve(str(path), "worker:0", env={}) == expected
    assert resolve(json.dumps(PLAIN), "worker:0", env={}) == expected


def test_task_from_a_tf_config_shaped_cluster_file(tmp_path):
    path = tmp_path / "tf.json"
    path.write_text(json.dumps(TF_SHAPED))
    assert resolve(env=env_of(cluster=str(path))) == (ClusterSpec(PLAIN), TaskId("worker", 1))
    assert resolve(path, env={}) == (ClusterSpec(PLAIN), TaskId("worker", 1))
    # the file's task beats TF_CONFIG's; ZMQFLOW_TASK and the argument beat the file's
    assert resolve(path, env=env_of(tf=TF_OTHER)) == (ClusterSpec(PLAIN), TaskId("worker", 1))
    assert resolve(path, env=env_of(task="ps:0")) == (ClusterSpec(PLAIN), TaskId("ps", 0))
    assert resolve(path, "worker:0", env=env_of(task="ps:0")) == (ClusterSpec(PLAIN), TaskId("worker", 0))


def test_missing_cluster():
    msg = config_error(resolve, env={})
    assert "no cluster given" in msg and "ZMQFLOW_CLUSTER" in msg and "TF_CONFIG" in msg
    assert "no cluster given" in config_error(resolve, task="worker:0", env=env_of(task="worker:0"))
    assert "no cluster given" in config_error(resolve, env={"ZMQFLOW_CLUSTER": ""})


def test_missing_task():
    msg = config_error(resolve, PLAIN, env={})
    assert "no task given" in msg and "ZMQFLOW_TASK" in msg
    assert "no task given" in config_error(resolve, PLAIN, env=env_of(tf={"cluster": OTHER}))
    assert resolve(PLAIN, env={}, require_task=False) == (ClusterSpec(PLAIN), None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cluster": PLAIN, "task": "worker:2", "env": {}},
        {"env": env_of(cluster=PLAIN, task="chief:0")},
        {"env": env_of(tf={"cluster": PLAIN, "task": {"type": "worker", "index": 7}})},
    ],
)
def test_task_not_in_cluster(kwargs):
    msg = config_error(resolve, **kwargs)
    assert "unknown task" in msg and "ps: 1, worker: 2" in msg


def test_malformed_task_from_the_environment():
    assert "malformed task 'worker-0'" in config_error(resolve, PLAIN, env=env_of(task="worker-0"))


@pytest.mark.parametrize("tf", ["{not json", "[1]", json.dumps(PLAIN), json.dumps({"cluster": ["h:1"]})])
def test_bad_tf_config(tf):
    msg = config_error(resolve, env=env_of(tf=tf))
    assert "TF_CONFIG" in msg


def test_bad_zmqflow_cluster_names_its_source(tmp_path):
    assert "inline cluster JSON is not valid JSON" in config_error(resolve, env=env_of(cluster="{oops"))
    missing = str(tmp_path / "missing.json")
    assert f"cannot read cluster file {missing!r}" in config_error(resolve, env=env_of(cluster=missing))


def test_resolve_without_a_required_task_ignores_a_stray_one():
    from zmqflow.cluster import resolve

    tf_config = '{"cluster": {"worker": ["127.0.0.1:9"]}, "task": {"type": "worker", "index": 0}}'
    spec, tid = resolve('{"ps": ["127.0.0.1:7"]}', None, env={"TF_CONFIG": tf_config}, require_task=False)
    assert tid is None and spec.jobs == ["ps"]


def test_load_config_refuses_a_list_with_a_config_error():
    from zmqflow.cluster import load_config
    from zmqflow.errors import ConfigError

    with pytest.raises(ConfigError, match="got list"):
        load_config(["127.0.0.1:1"])  # type: ignore[arg-type]
