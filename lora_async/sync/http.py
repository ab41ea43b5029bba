"""The `http` transport: new versions for remote `vllm serve` replicas.

A version becomes a standard PEFT directory written atomically (a temporary directory, then
one rename) under a sync directory the servers can read, then every replica is asked to load
it under its versioned name through `/v1/load_lora_adapter` (servers started with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; `lora-async serve --allow-updates` does that). When
one replica fails, the ones that loaded it unload it again, so every replica keeps the same
set. A drained version is unloaded everywhere and its directory removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..config import ADAPTER_NAME_RE

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0


class ServerError(RuntimeError):
    """A server that is down, refuses a request, or does not answer in time."""


class ServerSync:
    def __init__(self, urls: list[str], sync_dir: str | Path, api_key: str | None = None,
                 timeout_s: float = 60.0, retry_budget_s: float = 30.0) -> None:
        if not urls:
            raise ServerError("no server URLs given")
        self.urls = [u.rstrip("/") for u in urls]
        self.sync_dir = Path(sync_dir).resolve()
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.retry_budget_s = retry_budget_s
        self.api_key = api_key or os.environ.get("LORA_ASYNC_API_KEY")
        self._local = threading.local()  # one requests.Session per thread
        self._sessions: list[Any] = []

    def session(self) -> Any:
        import requests

        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
            self._sessions.append(session)
        return session

    # ---- the PEFT directory
    def version_dir(self, served_name: str) -> Path:
        """`sync_dir/<adapter>@v<k>`, refusing names that would land anywhere else."""
        adapter, _, version = served_name.partition("@v")
        if not ADAPTER_NAME_RE.fullmatch(adapter) or not version.isdigit():
            raise ValueError(f"adapter version name {served_name!r} is not '<name>@v<k>' with a plain "
                             "name (letters, digits, '_' and '-')")
        path = (self.sync_dir / served_name).resolve()
        if path.parent != self.sync_dir:
            raise ValueError(f"{served_name!r} escapes the sync directory {self.sync_dir}")
        return path

    def write(self, served_name: str, tensors: dict, peft_config: dict) -> tuple[Path, int]:
        """Write the PEFT directory atomically; returns its path and size in bytes."""
        import json

        from safetensors.torch import save_file

        final = self.version_dir(served_name)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.sync_dir))
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                      str(staging / "adapter_model.safetensors"))
            (staging / "adapter_config.json").write_text(json.dumps(peft_config))
            os.chmod(staging, 0o755)
            if final.exists():
                shutil.rmtree(final)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final, sum(f.stat().st_size for f in final.iterdir())

    def remove(self, served_name: str) -> None:
        shutil.rmtree(self.version_dir(served_name), ignore_errors=True)

    # ---- the servers
    def load(self, served_name: str, path: Path) -> None:
        """Load on every replica; on any failure unload where it loaded, then raise."""
        loaded: list[str] = []
        for url in self.urls:
            try:
                self.post(url, "/v1/load_lora_adapter", {"lora_name": served_name, "lora_path": str(path)})
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
        self.remove(served_name)

    def get(self, url: str, route: str) -> Any:
        return self._request("GET", url, route, None, retry=True).json()

    def post(self, url: str, route: str, payload: dict, retry: bool = True, timeout_s: float | None = None) -> Any:
        return self._request("POST", url, route, payload, retry, timeout_s)

    def _request(self, method: str, url: str, route: str, payload: dict | None, retry: bool,
                 timeout_s: float | None = None) -> Any:
        """Retry connection failures and 5xx with exponential backoff, within the retry budget;
        a 4xx is the server's answer and is raised at once."""
        import requests

        deadline = time.monotonic() + (self.retry_budget_s if retry else 0.0)
        delay, attempts = 0.2, 0
        while True:
            attempts += 1
            try:
                response = self.session().request(method, url + route, json=payload,
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
                                  f"in {self.retry_budget_s if retry else 0:.0f} s: {problem}")
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def close(self) -> None:
        for session in self._sessions:
            session.close()
