package router_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestBrokerClientsOnlyWhereUsed: the library packages a service links to
// write or relay events do not pull in a broker client; only the backend
// packages and the daemon do.
func TestBrokerClientsOnlyWhereUsed(t *testing.T) {
	t.Parallel()
	const mod = "github.com/outboxkit/watermill-outbox/"
	deps := func(pkg string) string {
		out, err := exec.Command("go", "list", "-deps", mod+pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
		}
		return string(out)
	}
	clients := []string{"github.com/IBM/sarama", "github.com/ThreeDotsLabs/watermill-kafka", "github.com/rabbitmq/amqp091-go", "github.com/ThreeDotsLabs/watermill-amqp"}
	for _, pkg := range []string{"publisher", "subscriber", "forwarder", "router", "schema", "inbox", "runbook", "cleaner", "metrics"} {
		d := deps(pkg)
		for _, c := range clients {
			if strings.Contains(d, c) {
				t.Errorf("package %s links %s", pkg, c)
			}
		}
	}
	if d := deps("router/kafkabackend"); !strings.Contains(d, "github.com/IBM/sarama") || strings.Contains(d, "amqp091") {
		t.Error("kafkabackend must link Sarama and no AMQP client")
	}
	if d := deps("router/amqpbackend"); !strings.Contains(d, "amqp091") || strings.Contains(d, "sarama") {
		t.Error("amqpbackend must link the AMQP client and not Sarama")
	}
}
