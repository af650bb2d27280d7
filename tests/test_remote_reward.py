"""grpolab.rewards.remote: an HTTP judge as a reward function, its failures counted as any
reward function's are."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from grpolab.rewards import RewardsConfig, load_rewards, remote, score
from grpolab.tasks import Example

SEEN: list[dict] = []


class Judge(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SEEN.append(body)
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/broken":
            self.send_response(500)
            self.end_headers()
            return
        rewards = [
            float(c.strip() == a) for c, a in zip(body["completions"], body["answer"], strict=True)
        ]
        answer = {"rewards": rewards} if self.path == "/dict" else rewards
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture(scope="module")
def url():
    server = HTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


EXAMPLES = [Example(prompt="2+2=", answer="4", columns={"level": 1})]


@pytest.mark.parametrize("path", ["/list", "/dict"])
def test_the_judge_scores_each_completion_and_sees_the_columns(url, path):
    SEEN.clear()
    result = score(["4", " 5", "4 "], EXAMPLES, [remote(url + path, timeout=5)])
    assert result.per_function["remote"].tolist() == [1.0, 0.0, 1.0]
    assert result.errors == {"remote": 0}
    assert SEEN[0]["prompts"] == ["2+2="] * 3 and SEEN[0]["level"] == [1, 1, 1]


@pytest.mark.parametrize(
    ("path", "timeout", "error"),
    [("/broken", 5, "HTTPError"), ("/slow", 0.3, "timed out"), ("/closed", 5, "URLError")],
)
def test_a_failing_judge_is_counted_and_gets_the_fallback(url, path, timeout, error):
    target = url + path if path != "/closed" else "http://127.0.0.1:9/x"  # port 9: discard
    rewards = load_rewards(
        RewardsConfig(functions=[remote(target, timeout=timeout)], fallback=-1.0)
    )
    result = score(["4", "5"], EXAMPLES, rewards)
    assert result.errors == {"remote": 2}
    assert result.per_function["remote"].tolist() == [-1.0, -1.0]
    assert error in result.error_texts["remote"]
