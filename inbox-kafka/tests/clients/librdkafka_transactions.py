"""Writes committed and aborted transactions to partition 0 of a topic with
librdkafka's transactional producer (the confluent-kafka wheel), as an
exactly-once upstream service would, interleaved with a plain producer:

1. producer "t-commit" begins and writes c-0, c-1;
2. producer "t-abort" begins and writes a-0 .. a-(ABORTED-1), 4 KiB each
   (larger than one fetch of the consumer under test);
3. the plain producer writes p-0 between them;
4. "t-commit" writes c-2 and commits; "t-abort" aborts;
5. "t-commit" writes c-3 in a second transaction and commits, so the log
   ends in a commit marker.

Every record carries a message_id header and the payload {"order": id}.
Prints one JSON object: {"committed": [...], "aborted": [...],
"plain": [...]}.

Usage: librdkafka_transactions.py BROKER TOPIC ABORTED
"""

import json
import sys

from confluent_kafka import Producer


def main() -> None:
    broker, topic, aborted_n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    common = {"bootstrap.servers": broker, "linger.ms": 5}
    committer = Producer({**common, "transactional.id": f"t-commit-{topic}"})
    aborter = Producer({**common, "transactional.id": f"t-abort-{topic}"})
    plain = Producer({**common, "enable.idempotence": True})
    for p in (committer, aborter):
        p.init_transactions(30)

    def send(producer, order, pad=0):
        value = {"order": order}
        if pad:
            value["pad"] = "x" * pad
        producer.produce(
            topic,
            json.dumps(value).encode(),
            partition=0,
            headers=[("message_id", order.encode()), ("event_type", b"order.created")],
        )

    out = {"committed": [], "aborted": [], "plain": []}
    committer.begin_transaction()
    for i in range(2):
        send(committer, f"c-{i}")
        out["committed"].append(f"c-{i}")
    committer.flush(30)
    aborter.begin_transaction()
    for i in range(aborted_n):
        send(aborter, f"a-{i}", pad=4096)
        out["aborted"].append(f"a-{i}")
    aborter.flush(30)
    send(plain, "p-0")
    out["plain"].append("p-0")
    if plain.flush(30) != 0:
        raise SystemExit("the plain record was not delivered")
    send(committer, "c-2")
    out["committed"].append("c-2")
    committer.commit_transaction(30)
    aborter.abort_transaction(30)
    committer.begin_transaction()
    send(committer, "c-3")
    out["committed"].append("c-3")
    committer.commit_transaction(30)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
