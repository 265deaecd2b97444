"""Creates a topic with topic configs through librdkafka's admin client
(the confluent-kafka wheel), as an operator's tooling would, and prints
{"created": TOPIC} once the brokers have it.

Usage: librdkafka_topic.py BROKER TOPIC PARTITIONS [NAME=VALUE ...]
(for instance max.message.bytes=4096)
"""

import json
import sys

from confluent_kafka.admin import AdminClient, NewTopic


def main() -> None:
    broker, topic, partitions = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = dict(arg.split("=", 1) for arg in sys.argv[4:])
    admin = AdminClient({"bootstrap.servers": broker})
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=1, config=config)],
        operation_timeout=30,
    )
    futures[topic].result(timeout=60)
    print(json.dumps({"created": topic}))


if __name__ == "__main__":
    main()
