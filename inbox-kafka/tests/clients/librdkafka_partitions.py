"""Asks librdkafka (the confluent-kafka wheel) where Kafka's default
partitioner puts keys: produces each key with `partitioner: murmur2_random`
(the Java client's default: murmur2 of the key) and reports the partition
each delivery report names. Prints one JSON object {key: partition}.

Usage: librdkafka_partitions.py BROKER TOPIC KEY...
"""

import json
import sys

from confluent_kafka import Producer


def main() -> None:
    broker, topic, keys = sys.argv[1], sys.argv[2], sys.argv[3:]
    placed = {}

    def report(err, msg):
        if err is not None:
            raise SystemExit(f"delivery failed: {err}")
        placed[msg.key().decode()] = msg.partition()

    producer = Producer({"bootstrap.servers": broker, "partitioner": "murmur2_random"})
    for key in keys:
        producer.produce(topic, b"{}", key=key.encode(), on_delivery=report)
    if producer.flush(30) != 0:
        raise SystemExit("not every record was delivered")
    print(json.dumps(placed))


if __name__ == "__main__":
    main()
