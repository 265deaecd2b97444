"""Writes N records to TOPIC with librdkafka (the confluent-kafka wheel), as
another team's service would: KEYS keys (key-0 ... key-(KEYS-1), record i
has key-(i % KEYS)), partitioned by the Java client's murmur2 partitioner,
each with a message_id and an event_type header and a JSON payload naming
its key and its sequence number within the key. Prints one JSON line: how
many records were written to each partition.

Usage: librdkafka_keyed.py BROKER TOPIC N KEYS
"""

import json
import sys

from confluent_kafka import Producer


def main() -> None:
    broker, topic, n, keys = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    producer = Producer(
        {
            "bootstrap.servers": broker,
            "partitioner": "murmur2_random",
            "enable.idempotence": True,
            "linger.ms": 20,
        }
    )
    partitions = {}

    def delivered(err, msg):
        if err is not None:
            sys.exit(f"not delivered: {err}")
        partitions[msg.partition()] = partitions.get(msg.partition(), 0) + 1

    for i in range(n):
        key = f"key-{i % keys}"
        seq = i // keys
        producer.produce(
            topic,
            json.dumps({"key": key, "seq": seq}).encode(),
            key=key.encode(),
            headers=[("message_id", f"m-{i}".encode()), ("event_type", b"order.created")],
            on_delivery=delivered,
        )
        producer.poll(0)
    left = producer.flush(60)
    if left:
        sys.exit(f"{left} records not delivered")
    print(json.dumps({"partitions": {str(p): c for p, c in sorted(partitions.items())}}))


if __name__ == "__main__":
    main()
