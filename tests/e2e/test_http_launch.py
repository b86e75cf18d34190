"""The launcher's HTTP process: `radixserve --http-port` serves the openai SDK, --api-key and RADIXSERVE_API_KEY are
enforced (401, /health open), the key never reaches a command line, a busy port fails start-up in one line, the
HTTP process stops with the rest, and `router.launch --http-port` fronts the router."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from router.launch import RouterLauncher, build_router_parser
from runtime.client import Client
from runtime.config import InvalidConfig, ServerArgs
from runtime.serve.http.process import check_bindable, connect_endpoint, http_child_env, url_host
from runtime.serve.launch import build_parser
from runtime.serve.process import StartupError
from tests.e2e.http_servers import http, scrape, start_http_server
from tests.e2e.processes import descendants, role_pids
from tests.e2e.servers import TINY_FLAGS
from tests.paths import ROOT

KEY = "sk-test-0123456789"


# ------------------------------------------------------------------------------------------------- no server
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"http_port": 70000}, "http_port must be None or in"),
        ({"http_port": -1}, "http_port must be None or in"),
        ({"api_key": ""}, "api_key must be None or a non-empty string"),
        ({"api_key": "  "}, "api_key must be None or a non-empty string"),
        ({"served_model_name": ""}, "served_model_name must be None or a non-empty string"),
    ],
)
def test_http_settings_out_of_range_raise(kwargs, message):
    with pytest.raises(InvalidConfig, match=message):
        ServerArgs(**kwargs)


def test_http_flags_of_both_launchers():
    flags = ["--http-port", "8000", "--api-key", KEY, "--served-model-name", "chat"]
    for parser in (build_parser(), build_router_parser()):
        ns = parser.parse_args(flags)
        assert (ns.http_port, ns.api_key, ns.served_model_name) == (8000, KEY, "chat")
        assert parser.parse_args([]).http_port is None
    router = RouterLauncher(ServerArgs(http_port=8000, api_key=KEY), replicas=2)
    try:
        assert router._replica_args().http_port is None  # one HTTP server, in front of the router only
    finally:
        router.shutdown("test")


def test_endpoints_and_hosts():
    assert connect_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert connect_endpoint("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert connect_endpoint("tcp://[::]:5557") == "tcp://[::1]:5557"
    assert connect_endpoint("tcp://[::1]:42") == "tcp://[::1]:42"
    with pytest.raises(ValueError, match="not a tcp://HOST:PORT endpoint"):
        connect_endpoint("ipc://@x/y")
    assert (url_host("::1"), url_host("[::1]"), url_host("10.0.0.1")) == ("[::1]", "[::1]", "10.0.0.1")


def test_api_key_goes_to_the_child_environment_only(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_API_KEY", "from-env")
    assert http_child_env(None)["RADIXSERVE_API_KEY"] == "from-env"
    assert http_child_env(KEY)["RADIXSERVE_API_KEY"] == KEY  # the flag wins
    monkeypatch.setenv("RADIXSERVE_API_KEY", "")
    assert "RADIXSERVE_API_KEY" not in http_child_env(None)  # empty: no key
    monkeypatch.delenv("RADIXSERVE_API_KEY")
    env = http_child_env(None)
    assert "RADIXSERVE_API_KEY" not in env and env["PATH"] == os.environ["PATH"]


def test_a_busy_port_is_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(StartupError, match=f"^cannot bind http_port 127.0.0.1:{port}: Address already in use$"):
            check_bindable("127.0.0.1", port)
    check_bindable("127.0.0.1", 0)


# ------------------------------------------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def keyed(tiny_llama_dir, tmp_path_factory):
    """The tiny model behind `radixserve --http-port 0 --api-key KEY --served-model-name tiny`."""
    server = start_http_server(
        str(tiny_llama_dir),
        tmp_path_factory.mktemp("logs") / "keyed.log",
        *TINY_FLAGS,
        "--api-key",
        KEY,
        "--served-model-name",
        "tiny",
    )
    yield server
    server.stop()


def test_launcher_serves_the_openai_sdk(keyed):
    from openai import OpenAI

    client = OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=4,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("length", 4)
    ids = list(range(300, 330))
    completion = client.completions.create(
        model="tiny", prompt=ids, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
    )
    with Client(keyed.endpoint, timeout=60) as zmq_client:  # the same server through ZeroMQ: the same tokens
        direct = zmq_client.generate(input_ids=ids, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert completion.choices[0].text == direct.text
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (30, 6)


def test_api_key_is_enforced_on_v1(keyed):
    import openai

    wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    assert http("GET", keyed.url + "/v1/models")[0] == 401
    status, body = http("POST", keyed.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert status == 401 and b"invalid_api_key" in body
    assert http("GET", keyed.url + "/health")[0] == 200
    assert scrape(keyed.url)  # /metrics needs no key (vLLM guards /v1 only)


def test_api_key_is_never_on_a_command_line(keyed):
    roles = role_pids(keyed.proc.pid)
    assert set(roles) == {"worker", "scheduler", "tokenizer", "http"}
    assert KEY.encode() in Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes()  # the user typed it there
    for pid in descendants(keyed.proc.pid):  # but it is copied onto no child's command line
        assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    assert f"RADIXSERVE_API_KEY={KEY}".encode() in Path(f"/proc/{roles['http']}/environ").read_bytes().split(b"\0")


def test_api_key_from_the_environment_and_shutdown_with_the_rest(tiny_llama_dir, tmp_path):
    env = {**os.environ, "RADIXSERVE_API_KEY": "sk-from-env"}
    server = start_http_server(str(tiny_llama_dir), tmp_path / "env.log", *TINY_FLAGS, env=env)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        assert http("POST", server.url + "/v1/completions", body)[0] == 401
        status, answer = http("POST", server.url + "/v1/completions", body, {"Authorization": "Bearer sk-from-env"})
        assert status == 200, answer[:300]
        children = descendants(server.proc.pid)
        assert "http" in role_pids(server.proc.pid)
    finally:
        code = server.stop()
    assert code == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in children):
        time.sleep(0.1)
    assert [pid for pid in children if Path(f"/proc/{pid}").exists()] == []


def test_a_busy_http_port_fails_start_up_in_one_line(tiny_llama_dir, tmp_path):
    log = tmp_path / "busy.log"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "runtime.launch",
            "--model",
            str(tiny_llama_dir),
            "--port",
            "0",
            "--http-port",
            str(port),
            *TINY_FLAGS,
        ]
        with open(log, "w") as err:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=300)
    assert proc.returncode == 1
    assert "radixserve ready at" not in proc.stdout
    lines = [line for line in log.read_text().splitlines() if "start-up failed" in line]
    assert len(lines) == 1 and lines[0].endswith(
        f"start-up failed: http process failed to start: cannot bind http_port 127.0.0.1:{port}: Address already in use"
    ), lines


def test_router_launch_with_http_port(tiny_llama_dir, tmp_path):
    from openai import OpenAI

    server = start_http_server(
        str(tiny_llama_dir), tmp_path / "router.log", "--replicas", "1", *TINY_FLAGS, module="router.launch"
    )
    try:
        assert role_pids(server.proc.pid).get("http") is not None
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model=str(tiny_llama_dir),
            prompt=list(range(40, 60)),
            max_tokens=3,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (20, 3)
        metrics = scrape(server.url)
        assert metrics[("radixserve:prompt_tokens_total", (("model_name", str(tiny_llama_dir)),))] >= 20
    finally:
        server.proc.send_signal(signal.SIGTERM)  # the HTTP server drains (nothing in flight), then all stop
        assert server.proc.wait(60) == 0
