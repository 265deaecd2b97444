"""Reads a topic with librdkafka (the confluent-kafka wheel), as another
team's service would, and prints what it read: one JSON list of records
(partition, offset, key, value, headers as [name, value] pairs in the
order librdkafka returns them).

Reads partition 0 from its beginning, assigned (no group join).

Usage: librdkafka_consume.py BROKER TOPIC COUNT
(COUNT 0: every record up to the partition's end, however many)
"""

import json
import sys
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition


def text(b):
    return None if b is None else b.decode("utf-8", "replace")


def main() -> None:
    broker, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    consumer = Consumer(
        {
            "bootstrap.servers": broker,
            "group.id": f"librdkafka-reader-{time.time_ns()}",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    out, deadline = [], time.time() + 60
    end = None
    if count == 0:
        _, end = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
    while time.time() < deadline:
        if end is None and len(out) >= count:
            break
        if end is not None and (not out and end == 0 or out and out[-1]["offset"] + 1 >= end):
            break
        m = consumer.poll(1.0)
        if m is None:
            continue
        if m.error():
            sys.exit(f"librdkafka: {m.error()}")
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
