"""Writes a topic with librdkafka (the confluent-kafka wheel), as another
team's service would: every codec tansu serves (gzip, lz4, zstd; tansu
cannot serve snappy batches), idempotence on, keys, headers, and a
tombstone (a record without a value); headers with a repeated name, in
an order no sort gives. Prints one JSON line: what was
produced, for the test to check against.

Usage: librdkafka_produce.py BROKER TOPIC
"""

import json
import sys

from confluent_kafka import Producer


def main() -> None:
    broker, topic = sys.argv[1], sys.argv[2]
    valid, tombstones, records = [], [], 0
    for codec in ["gzip", "lz4", "zstd"]:
        producer = Producer(
            {
                "bootstrap.servers": broker,
                "compression.type": codec,
                "enable.idempotence": True,
                "linger.ms": 50,
            }
        )
        for i in range(3):
            order = f"{codec}-{i}"
            producer.produce(
                topic,
                json.dumps({"order": order, "total": 10}).encode(),
                key=f"customer-{i}".encode(),
                partition=0,
                headers=[
                    ("message_id", order.encode()),
                    ("hop", b"gateway"),
                    ("event_type", b"order.created"),
                    ("hop", b"billing"),
                    ("a", b"last"),
                ],
            )
            valid.append(order)
            records += 1
        tombstone = f"{codec}-tombstone"
        producer.produce(
            topic,
            None,
            key=b"customer-0",
            partition=0,
            headers=[("message_id", tombstone.encode())],
        )
        tombstones.append(tombstone)
        records += 1
        left = producer.flush(30)
        if left:
            sys.exit(f"{left} records of {codec} not delivered")
    print(json.dumps({"valid": valid, "tombstones": tombstones, "records": records}))


if __name__ == "__main__":
    main()
