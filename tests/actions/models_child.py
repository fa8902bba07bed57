"""A function instance for tests/actions/test_models.py: loads a model, then answers commands on stdin."""

import json
import sys

from dilu_invoker.actions import models


def main() -> None:
    name, path = sys.argv[1], sys.argv[2]
    value = models.load(name, path, device="cpu")
    while True:
        m = models.info(name)
        assert m is not None
        first = value["w"]
        print(json.dumps({"role": m.role, "reason": m.reason, "reloads": m.reloads, "nbytes": m.nbytes,
                          "sum": float(first.sum()), "first": float(first.reshape(-1)[0]),
                          "served": m.holder.served if m.holder else 0,
                          "refused": m.holder.refused if m.holder else 0}), flush=True)
        line = sys.stdin.readline().strip()
        if not line or line == "exit":
            return
        if line.startswith("set "):  # writes into the holder's copy (the mapper must see it: no copy)
            first.reshape(-1)[0] = float(line.split()[1])


if __name__ == "__main__":
    main()
