package pgmeta

import "testing"

// TestKeysAreStable pins every derived key of one table: writers and relays
// of different versions run side by side during a rolling upgrade, and they
// agree on a lock only while its key is derived the same way. The values are
// those of the versions before this package existed.
func TestKeysAreStable(t *testing.T) {
	t.Parallel()
	const q = "public.app_outbox"
	for _, c := range []struct {
		name      string
		got, want int64
	}{
		{"Leader", Leader(q), 3222697970430597938},
		{"Idle", Idle(q), -3597231964250232421},
		{"OrderedIdle", OrderedIdle(q), -2659701664873910617},
		{"RelayMode(ordered)", RelayMode(q, true), 4730137528283432022},
		{"RelayMode(default)", RelayMode(q, false), -1967273178010012386},
		{"Migrate", Migrate(q), -2939536069653274986},
		{"LegacyOrderingClass", int64(LegacyOrderingClass(q)), 2005479967},
		{"WALSlot", int64(WALSlot(q)), 0xd66d5c3},
		{"WALFence", WALFence("outbox_public_app_outbox"), -2377010171711599136},
	} {
		if c.got != c.want {
			t.Errorf("%s(%q) = %d, want %d: a relay or writer of another version would not see this lock", c.name, q, c.got, c.want)
		}
	}
	if ch := NotifyChannel(q); ch != "outbox:public.app_outbox" {
		t.Errorf("NotifyChannel = %q", ch)
	}
	long := "public.a_table_name_long_enough_to_pass_the_channel_limit_of_63_bytes"
	if ch := NotifyChannel(long); len(ch) > 63 {
		t.Errorf("NotifyChannel of a long name is %d bytes, over PostgreSQL's 63", len(ch))
	}
}

func TestInferMode(t *testing.T) {
	for _, c := range []struct {
		walProgress, published, ordered, key bool
		want                                 string
	}{
		{true, true, true, true, "wal"},
		{true, true, false, false, "wal"},
		{true, false, true, true, "ordered"}, // a progress table without a publication: not streamed
		{false, true, true, true, "ordered"}, // a publication of its own (not the WAL relay's): ordered tables decide
		{false, false, true, false, "default"},
		{false, false, false, true, "default"},
		{false, false, false, false, "default"},
	} {
		if got := InferMode(c.walProgress, c.published, c.ordered, c.key); got != c.want {
			t.Errorf("InferMode(progress %v, published %v, ordered tables %v, ordering_key %v) = %s, want %s", c.walProgress, c.published, c.ordered, c.key, got, c.want)
		}
	}
}
