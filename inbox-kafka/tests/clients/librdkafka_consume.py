"""Reads a topic with librdkafka (the confluent-kafka wheel), as another
team's service would, and prints what it read: one JSON list of records
(partition, offset, key, value, headers as [name, value] pairs in the
order librdkafka returns them).

Reads partitions 0..PARTITIONS (default 1) from their beginning, assigned
(no group join).

Usage: librdkafka_consume.py BROKER TOPIC COUNT [PARTITIONS]
(COUNT 0: every record up to each partition's end, however many)
"""

import json
import sys
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition


def text(b):
    return None if b is None else b.decode("utf-8", "replace")


def main() -> None:
    broker, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    partitions = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    consumer = Consumer(
        {
            "bootstrap.servers": broker,
            "group.id": f"librdkafka-reader-{time.time_ns()}",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    out, deadline = [], time.time() + 60
    ends, at = None, {}
    if count == 0:
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
            for p in range(partitions)
        }
    while time.time() < deadline:
        if ends is None and len(out) >= count:
            break
        if ends is not None and all(at.get(p, 0) >= end for p, end in ends.items()):
            break
        m = consumer.poll(1.0)
        if m is None:
            continue
        if m.error():
            sys.exit(f"librdkafka: {m.error()}")
        at[m.partition()] = m.offset() + 1
        out.append(
            {
                "partition": m.partition(),
                "offset": m.offset(),
                "key": text(m.key()),
                "value": text(m.value()),
                "headers": [[k, text(v)] for k, v in (m.headers() or [])],
            }
        )
    consumer.close()
    if len(out) < count:
        sys.exit(f"read {len(out)} records of {count} within 60 s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
