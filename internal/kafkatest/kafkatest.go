// Package kafkatest runs an in-process Kafka-protocol cluster (franz-go's
// kfake) that Watermill's Kafka backend (Sarama) talks to for real, and a
// Sarama-based Watermill subscriber configured to read it from the oldest
// offset. Tests, examples and the demo use it; there is no Kafka server on
// this project's machines.
package kafkatest

import (
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Cluster is a running in-process Kafka cluster.
type Cluster struct {
	c *kfake.Cluster
}

// Start starts a cluster of one broker with topic auto-creation and
// partitions partitions per topic (at least 1), on a free local port, or on
// port when it is not 0 (to restart a cluster at the same address).
func Start(partitions int32, port int) (*Cluster, error) {
	opts := []kfake.Opt{kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(int(max(1, partitions)))}
	if port != 0 {
		opts = append(opts, kfake.Ports(port))
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, fmt.Errorf("start in-process Kafka cluster: %w", err)
	}
	return &Cluster{c: c}, nil
}

// StartOn is Start on a free port of the local address host (reachable, for
// example, from processes in other network namespaces).
func StartOn(host string, partitions int32) (*Cluster, error) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(int(max(1, partitions))),
		kfake.ListenFn(func(network, _ string) (net.Listener, error) { return net.Listen(network, net.JoinHostPort(host, "0")) }))
	if err != nil {
		return nil, fmt.Errorf("start in-process Kafka cluster on %s: %w", host, err)
	}
	return &Cluster{c: c}, nil
}

// Brokers are the bootstrap addresses.
func (c *Cluster) Brokers() []string { return c.c.ListenAddrs() }

// SlowProduce makes the broker answer every produce request d late, like a
// slow or distant broker, until Produces.Fast or the cluster closes. Other
// requests are served meanwhile. The Produces it returns counts the
// produce requests the broker holds.
func (c *Cluster) SlowProduce(d time.Duration) *Produces {
	p := &Produces{}
	c.c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.c.KeepControl()
		if p.fast.Load() {
			return nil, nil, false
		}
		p.held.Add(1)
		c.c.SleepControl(func() { time.Sleep(d) })
		p.held.Add(-1)
		return nil, nil, false
	})
	return p
}

// Produces counts the produce requests a slow broker (SlowProduce) holds.
type Produces struct {
	held atomic.Int64
	fast atomic.Bool
}

// Held is the number of produce requests the broker received and has not
// answered yet: messages in a producer's hands, waiting for the broker.
func (p *Produces) Held() int64 { return p.held.Load() }

// Fast makes the broker answer the produce requests it receives from now on
// at once.
func (p *Produces) Fast() { p.fast.Store(true) }

// Close stops the cluster; its data is gone.
func (c *Cluster) Close() { c.c.Close() }

// NewSubscriber returns a watermill-kafka subscriber of the cluster in
// consumer group group, reading from the oldest offset.
func (c *Cluster) NewSubscriber(group string, logger watermill.LoggerAdapter) (*kafka.Subscriber, error) {
	sc := kafka.DefaultSaramaSubscriberConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Consumer.Offsets.Initial = sarama.OffsetOldest
	return kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               c.Brokers(),
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: sc,
		ConsumerGroup:         group,
	}, logger)
}
