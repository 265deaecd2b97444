"""A consumer group as librdkafka (the confluent-kafka wheel) sees it, as
Kafka's own tools would: read the offsets a group committed at the group
coordinator, or commit some as a standalone consumer (assigned
partitions, no group join), as an existing service would have.

Usage:
  librdkafka_group.py committed BROKER GROUP TOPIC PARTITIONS
      prints {"<partition>": <offset or null>} for partitions 0..PARTITIONS
  librdkafka_group.py lag BROKER GROUP TOPIC PARTITIONS
      prints {"<partition>": <high watermark - committed, or null>}, the
      lag kafka-consumer-groups --describe shows
  librdkafka_group.py commit BROKER GROUP TOPIC PARTITION OFFSET
      commits OFFSET (the next offset to read) for the partition
"""

import json
import sys

from confluent_kafka import Consumer, TopicPartition


def consumer(broker: str, group: str) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": broker,
            "group.id": group,
            "enable.auto.commit": False,
        }
    )


def main() -> None:
    command, broker, group, topic = sys.argv[1:5]
    c = consumer(broker, group)
    if command in ("committed", "lag"):
        n = int(sys.argv[5])
        found = c.committed([TopicPartition(topic, p) for p in range(n)], timeout=30)
        out = {}
        for tp in found:
            if tp.error:
                sys.exit(f"librdkafka: {tp.error}")
            if tp.offset < 0:
                out[str(tp.partition)] = None
            elif command == "lag":
                _, high = c.get_watermark_offsets(tp, timeout=30)
                out[str(tp.partition)] = high - tp.offset
            else:
                out[str(tp.partition)] = tp.offset
        print(json.dumps(out))
    elif command == "commit":
        partition, offset = int(sys.argv[5]), int(sys.argv[6])
        c.assign([TopicPartition(topic, partition)])
        done = c.commit(
            offsets=[TopicPartition(topic, partition, offset)], asynchronous=False
        )
        for tp in done or []:
            if tp.error:
                sys.exit(f"librdkafka: {tp.error}")
        print(json.dumps({"committed": offset}))
    else:
        sys.exit(f"unknown command {command}")
    c.close()


if __name__ == "__main__":
    main()
