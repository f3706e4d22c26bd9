"""The ``meshnet`` command as a user runs it: chat against a real server, and clear failures."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.procs import MESHNET, Proc

pytestmark = pytest.mark.real


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MESHNET, *args], capture_output=True, text=True, timeout=timeout, check=False)


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "meshnet"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0 and out.stdout.startswith("meshnet ")


def test_chat_one_prompt_streams_the_answer(server: Proc, model_id: str) -> None:
    prompt = "What is the capital of France?"
    out = run("chat", prompt, "--url", server.url, "--temperature", "0", "--max-tokens", "30")
    assert out.returncode == 0, out.stderr
    expected = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": model_id,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": 30,
        },
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    assert expected and out.stdout == expected + "\n"
    assert "tok/s" in out.stderr and "completed" in out.stderr  # the closing status line


def test_chat_reports_an_unreachable_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run("chat", "hi", "--url", f"http://127.0.0.1:{port}", timeout=30)
    assert out.returncode == 1
    assert "cannot reach" in out.stderr


def test_serve_refuses_a_missing_or_non_gguf_file(tmp_path: Path) -> None:
    out = run("serve", "--gguf", str(tmp_path / "missing.gguf"), "--port", "0", timeout=60)
    assert out.returncode == 2
    assert "not found" in out.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    out = run("serve", "--gguf", str(junk), "--port", "0", timeout=60)
    assert out.returncode == 2
    assert "not a GGUF file" in out.stderr


def test_serve_refuses_a_taken_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = run("serve", "--port", str(port), timeout=60)
    assert out.returncode != 0
    assert "already in use" in out.stderr


def test_serve_refuses_bad_flags() -> None:
    out = run("serve", "--threads", "0", "--port", "0", timeout=60)
    assert out.returncode != 0
    assert "--threads must be >= 1" in out.stderr


def test_node_refuses_an_address_no_peer_can_dial() -> None:
    """Bound to every interface, a node would advertise http://0.0.0.0:PORT: refused before the model loads."""
    out = run("node", "--layers", "0:10", "--host", "0.0.0.0", "--port", "0", timeout=60)
    assert out.returncode == 2 and "give --advertise-url" in out.stderr, out.stderr
    for bad, says in (("http://0.0.0.0:7000", "wildcard address"), ("http://h:7000/x", "no user, path"),
                      ("http://h", "explicit port"), ("ftp://h:1", "http://HOST:PORT")):  # fmt: skip
        out = run("node", "--layers", "0:10", "--public-url", bad, "--port", "0", timeout=60)
        assert out.returncode == 2 and says in out.stderr, (bad, out.stderr)


def test_up_refuses_a_missing_gguf_and_too_many_nodes(tmp_path: Path) -> None:
    out = run("up", "--gguf", str(tmp_path / "missing.gguf"), timeout=60)
    assert out.returncode == 2 and "GGUF file not found" in out.stderr
    out = run("up", "--nodes", "40", timeout=60)
    assert out.returncode == 2 and "--nodes must be within 1..30" in out.stderr


def test_an_api_beyond_loopback_needs_keys_or_no_auth(tmp_path: Path) -> None:
    """Like llama-server, loopback serves without keys; any other address needs --api-keys (or --no-auth)."""
    for command in (["serve"], ["gateway", "--tracker", "http://127.0.0.1:9"], ["up"]):
        out = run(*command, "--host", "0.0.0.0", "--port", "0", timeout=60)
        assert out.returncode == 2 and "needs --api-keys FILE" in out.stderr, (command, out.stderr)
    keys = tmp_path / "keys"
    keys.write_text("short\n")
    out = run("serve", "--api-keys", str(keys), "--port", "0", timeout=60)
    assert out.returncode == 2 and "at least 16 characters" in out.stderr, out.stderr
    out = run("serve", "--api-keys", str(tmp_path / "missing"), "--port", "0", timeout=60)
    assert out.returncode == 2 and "cannot read" in out.stderr, out.stderr
    keys.write_text("sk-0123456789abcdef\n")
    out = run("serve", "--api-keys", str(keys), "--no-auth", "--port", "0", timeout=60)
    assert out.returncode == 2 and "contradict" in out.stderr, out.stderr
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}")
    out = run("serve", "--chat-template-file", str(template), "--port", "0", timeout=60)
    assert out.returncode == 2 and "does not parse" in out.stderr, out.stderr


def test_serve_with_api_keys_through_the_official_client(tmp_path: Path) -> None:
    import openai

    from tests.procs import meshnet_process

    keys = tmp_path / "keys"
    keys.write_text("# one key\nsk-test-0123456789abcdef\n")
    args = ["serve", "--port", "0", "--threads", "2", "--ctx", "512", "--api-keys", str(keys)]
    with meshnet_process(args) as proc:
        model = "SmolLM2-135M-Instruct.Q4_1"
        with openai.OpenAI(base_url=f"{proc.url}/v1", api_key="sk-test-0123456789abcdef", max_retries=0) as ok:
            out = ok.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            assert out.choices[0].message.content
        with openai.OpenAI(base_url=f"{proc.url}/v1", api_key="sk-wrong-0123456789abcdef", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as info:
                bad.models.list()
            assert info.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        assert httpx.get(f"{proc.url}/health", timeout=10).status_code == 200


def test_a_trusted_only_key_needs_a_private_swarm(tmp_path: Path) -> None:
    """A key whose policy asks for trusted nodes only, on a gateway of an open swarm (no tiers): exit 2."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-0123456789abcdef", "name": "ops", "trusted_only": True}]}))
    out = run("gateway", "--tracker", "http://127.0.0.1:9", "--port", "0", "--api-keys", str(keys), timeout=60)
    assert out.returncode == 2 and "trusted_only policy of key(s) ops needs a private swarm" in out.stderr, out.stderr
