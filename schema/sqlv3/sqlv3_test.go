package sqlv3_test

import (
	"context"
	"database/sql"
	"os/exec"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/schema/sqlv3"
)

// TestAdapterWithStockWatermillSQL runs watermill-sql v3's own NewPublisher and
// NewSubscriber over an outbox table through sqlv3.Adapter, passed as both
// the schema and the offsets adapter: every message arrives
// once, a nacked one again, and the acks leave the rows published.
func TestAdapterWithStockWatermillSQL(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "org_outbox", schema.WithHeadersColumn())
	db, err := sql.Open("pgx", testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	adapter := sqlv3.Adapter{Table: tbl, Columns: schema.Columns{Headers: true}, BatchSize: 10}

	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: adapter}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		SchemaAdapter: adapter, OffsetsAdapter: adapter, PollInterval: 20 * time.Millisecond,
		ResendInterval: 20 * time.Millisecond,
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()

	const topic = "org.organization.created.v1"
	tenant := uuid.NewString()
	sent := map[string]bool{}
	var first string
	for i := range 25 {
		m := message.NewMessage(uuid.NewString(), []byte(`{"n":`+strings.Repeat("1", i%3+1)+`}`))
		m.Metadata.Set(schema.MetadataTenantID, tenant)
		m.Metadata.Set("correlation_id", "c")
		sent[m.UUID] = true
		if i == 0 {
			first = m.UUID
		}
		if err := pub.Publish(topic, m); err != nil {
			t.Fatal(err)
		}
	}
	// Another topic in the same table is not delivered to this subscription.
	other := message.NewMessage(uuid.NewString(), []byte(`{}`))
	other.Metadata.Set(schema.MetadataTenantID, tenant)
	if err := pub.Publish("org.organization.deleted.v1", other); err != nil {
		t.Fatal(err)
	}
	bad := message.NewMessage("not-a-uuid", []byte(`{}`))
	bad.Metadata.Set(schema.MetadataTenantID, tenant)
	if err := pub.Publish(topic, bad); err == nil || !strings.Contains(err.Error(), "UUID") {
		t.Fatalf("non-UUID message accepted: %v", err)
	}
	noTenant := message.NewMessage(uuid.NewString(), []byte(`{}`))
	if err := pub.Publish(topic, noTenant); err == nil || !strings.Contains(err.Error(), "tenant_id") {
		t.Fatalf("message without tenant accepted: %v", err)
	}
	notJSON := message.NewMessage(uuid.NewString(), []byte(`x`))
	notJSON.Metadata.Set(schema.MetadataTenantID, tenant)
	if err := pub.Publish(topic, notJSON); err == nil || !strings.Contains(err.Error(), "JSON") {
		t.Fatalf("non-JSON payload accepted: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	nacked := false
	for len(sent) > 0 {
		select {
		case m := <-msgs:
			if !sent[m.UUID] {
				t.Fatalf("unexpected or repeated message %s", m.UUID)
			}
			if m.Metadata.Get(schema.MetadataEventID) != m.UUID || m.Metadata.Get(schema.MetadataTenantID) != tenant ||
				m.Metadata.Get(schema.MetadataTopic) != topic || m.Metadata.Get(schema.MetadataAttempts) != "1" ||
				m.Metadata.Get(schema.MetadataTable) != tbl.String() || m.Metadata.Get("correlation_id") != "c" ||
				m.Metadata.Get(schema.MetadataSequence) == "" {
				t.Fatalf("metadata %v", m.Metadata)
			}
			if m.UUID == first && !nacked {
				nacked = true
				m.Nack() // delivered again, then acked
				continue
			}
			delete(sent, m.UUID)
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%d messages not received", len(sent))
		}
	}
	pool := testdb.Pool(t)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var published, locked, pending int
		err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE published_at IS NOT NULL), count(*) FILTER (WHERE locked_at IS NOT NULL),
			count(*) FILTER (WHERE published_at IS NULL) FROM `+tbl.Sanitize()).Scan(&published, &locked, &pending)
		if err != nil {
			t.Fatal(err)
		}
		if published == 25 && locked == 0 && pending == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("published %d locked %d pending %d, want 25/0/1", published, locked, pending)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSameSQLAsSchemaAdapter: the v3 adapter renders exactly the statements
// of sqlq.Adapter's Statement methods, so sqlv3.Adapter(a) of a configured
// sqlq.Adapter runs the SQL that a does.
func TestSameSQLAsSchemaAdapter(t *testing.T) {
	t.Parallel()
	a := sqlq.Adapter{Table: schema.MustParseTable("app.org_outbox"), Columns: schema.Columns{Headers: true, TraceContext: true}, BatchSize: 7}
	v3 := sqlv3.Adapter(a)
	m := message.NewMessage(uuid.NewString(), []byte(`{"a":1}`))
	m.Metadata.Set(schema.MetadataTenantID, uuid.NewString())
	msgs := message.Messages{m}

	ins, err := a.InsertStatement("org.x.v1", msgs)
	q3, err3 := v3.InsertQuery("org.x.v1", msgs)
	if err != nil || err3 != nil || ins.SQL != q3.Query || !reflect.DeepEqual(ins.Args, q3.Args) {
		t.Fatalf("insert differs:\nschema %v %v\nv3 %v %v", ins, err, q3, err3)
	}
	if _, err := v3.InsertQuery("org.x.v1", message.Messages{message.NewMessage("not-a-uuid", []byte(`{}`))}); err == nil {
		t.Fatal("non-UUID message accepted")
	}
	claim := a.ClaimStatement("org.x.v1")
	s3 := v3.SelectQuery("org.x.v1", "", v3)
	if claim.SQL != s3.Query || !reflect.DeepEqual(claim.Args, s3.Args) {
		t.Fatalf("select differs:\nschema %v\nv3 %v", claim, s3)
	}
	all := a.ClaimStatement(sqlq.AllTopics)
	s3 = v3.SelectQuery(sqlq.AllTopics, "", v3)
	if all.SQL != s3.Query || !reflect.DeepEqual(all.Args, s3.Args) || all.SQL == claim.SQL {
		t.Fatalf("select of every topic differs:\nschema %v\nv3 %v", all, s3)
	}
	ack := a.AckStatement(42)
	a3 := v3.AckMessageQuery("org.x.v1", wsql.Row{Offset: 42}, "")
	if ack.SQL != a3.Query || !reflect.DeepEqual(ack.Args, a3.Args) {
		t.Fatalf("ack differs:\nschema %v\nv3 %v", ack, a3)
	}
	ddl := a.SchemaStatements()
	d3 := v3.SchemaInitializingQueries("org.x.v1")
	if len(ddl) == 0 || len(ddl) != len(d3) {
		t.Fatalf("DDL: %d schema statements, %d v3", len(ddl), len(d3))
	}
	for i := range ddl {
		if ddl[i].SQL != d3[i].Query {
			t.Fatalf("DDL statement %d differs:\nschema %s\nv3 %s", i, ddl[i].SQL, d3[i].Query)
		}
	}
	if v3.SubscribeIsolationLevel() != sql.LevelReadCommitted || a.SubscribeIsolationLevel() != sql.LevelReadCommitted {
		t.Fatal("isolation level is not READ COMMITTED")
	}
	if q := v3.ConsumedMessageQuery("org.x.v1", wsql.Row{Offset: 42}, "", nil); q.Query != "" {
		t.Fatalf("consumed query %q, want none", q.Query)
	}
	if q := v3.NextOffsetQuery("org.x.v1", ""); q.Query != "" {
		t.Fatalf("next offset query %q, want none", q.Query)
	}
	if qs := v3.BeforeSubscribingQueries("org.x.v1", ""); len(qs) != 0 {
		t.Fatalf("before subscribing queries %v, want none", qs)
	}
}

// TestOnlySqlv3LinksV3: the packages a user imports for the outbox (schema,
// publisher, subscriber, forwarder) and their tests depend on no
// watermill-sql, and so on neither pgx v4, the MySQL driver nor appengine,
// which watermill-sql v3 brings: none of these reach a user's go.sum (go mod
// tidy keeps the sums of the tests of the packages a module imports, so a
// test here importing watermill-sql would bring it back). Package sqlv3 does
// depend on watermill-sql v3.
func TestOnlySqlv3LinksV3(t *testing.T) {
	t.Parallel()
	const module = "github.com/outboxkit/watermill-outbox/"
	deps := func(args ...string) string {
		// go test puts the go command that runs it first on PATH.
		out, err := exec.Command("go", append([]string{"list", "-deps"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	heavy := []string{
		"github.com/ThreeDotsLabs/watermill-sql/", // any major version
		"github.com/jackc/pgx/v4",
		"github.com/go-sql-driver/",
		"google.golang.org/appengine",
	}
	for _, pkg := range []string{"schema", "publisher", "subscriber", "forwarder"} {
		for _, dep := range strings.Fields(deps("-test", module+pkg)) {
			for _, h := range heavy {
				if strings.HasPrefix(dep, h) {
					t.Errorf("package %s or its tests depend on %s; only schema/sqlv3 and schema/sqlv4 (and their tests) may import watermill-sql", pkg, dep)
				}
			}
		}
	}
	if !strings.Contains(deps(module+"schema/sqlv3"), "github.com/ThreeDotsLabs/watermill-sql/v3/") {
		t.Fatal("package sqlv3 does not depend on watermill-sql v3")
	}
}
