"""`ServerClient`: HTTP to the `vllm serve` replicas a run drives.

Retries connection failures and 5xx answers with exponential backoff within a retry budget (a
4xx is the server's answer and is raised at once); loads an adapter version on every replica or
on none (one that fails rolls the others back); unloads best effort. One `requests.Session`
per thread. Servers need runtime LoRA updating (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`) and
processed logprobs: `lora-async server MODEL` starts one that way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ...errors import RunError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # a replica that does not accept a connection in this time is down
FIRST_RETRY_S = 0.2  # backoff: the first wait between attempts, doubled each time ...
MAX_RETRY_WAIT_S = 5.0  # ... up to this
DEFAULT_TIMEOUT_S = 60.0  # an answer to a control call (load, unload, list)
DEFAULT_RETRY_BUDGET_S = 30.0


class ServerError(RunError):
    """A server that is down, refuses a request, or does not answer in time."""


class ServerClient:
    def __init__(self, urls: list[str], api_key: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry_budget_s: float = DEFAULT_RETRY_BUDGET_S) -> None:
        if not urls:
            raise ServerError("no server URLs given")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.retry_budget_s = retry_budget_s
        self.api_key = api_key or os.environ.get("LORA_ASYNC_API_KEY")
        self._local = threading.local()
        self._sessions: list[Any] = []
        self._sessions_lock = threading.Lock()

    # ---- adapters on every replica
    def load(self, served_name: str, path: str, timeout_s: float | None = None,
             retry_budget_s: float | None = None) -> None:
        """Load a PEFT directory on every replica; on any failure unload where it loaded, then raise."""
        loaded: list[str] = []
        for url in self.urls:
            try:
                self._request("POST", url, "/v1/load_lora_adapter", {"lora_name": served_name, "lora_path": path},
                              retry=True, timeout_s=timeout_s, budget_s=retry_budget_s)
            except ServerError as exc:
                for done in loaded:
                    try:
                        self.post(done, "/v1/unload_lora_adapter", {"lora_name": served_name}, retry=False)
                    except ServerError as undo:
                        log.error("rollback of %s on %s failed: %s", served_name, done, undo)
                raise ServerError(f"loading {served_name} failed on {url} ({exc}); rolled back on "
                                  f"{len(loaded)} other replica(s)") from exc
            loaded.append(url)

    def unload(self, served_name: str) -> None:
        """Unload on every replica (best effort: a replica that lost it already is fine)."""
        for url in self.urls:
            try:
                self.post(url, "/v1/unload_lora_adapter", {"lora_name": served_name}, retry=False)
            except ServerError as exc:
                log.warning("unloading %s on %s: %s", served_name, url, exc)

    def served(self, url: str) -> list[dict]:
        """What one replica lists under /v1/models (the base model and every loaded adapter)."""
        return list(self.get(url, "/v1/models")["data"])

    # ---- requests
    def get(self, url: str, route: str) -> Any:
        return self._request("GET", url, route, None, retry=True).json()

    def post(self, url: str, route: str, payload: dict, retry: bool = True, timeout_s: float | None = None) -> Any:
        return self._request("POST", url, route, payload, retry, timeout_s)

    def _request(self, method: str, url: str, route: str, payload: dict | None, retry: bool,
                 timeout_s: float | None = None, budget_s: float | None = None) -> Any:
        import requests

        budget = (self.retry_budget_s if budget_s is None else budget_s) if retry else 0.0
        deadline = time.monotonic() + budget
        delay, attempts = FIRST_RETRY_S, 0
        while True:
            attempts += 1
            try:
                response = self._session().request(method, url + route, json=payload,
                                                   timeout=(CONNECT_TIMEOUT_S, timeout_s or self.timeout_s))
                if response.status_code < 400:
                    return response
                problem = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code < 500:
                    raise ServerError(f"{method} {url}{route}: {problem}")
            except requests.RequestException as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                raise ServerError(f"{method} {url}{route} failed after {attempts} attempt(s) "
                                  f"in {budget:.0f} s: {problem}")
            time.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_WAIT_S)

    def _session(self) -> Any:
        import requests

        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
            with self._sessions_lock:
                self._sessions.append(session)
        return session

    def close(self) -> None:
        with self._sessions_lock:
            for session in self._sessions:
                session.close()
