package walrelay

import (
	"encoding/binary"
	"testing"

	"github.com/jackc/pglogrepl"
)

// TestDecodeInsert: decodeInsert reads what pglogrepl.Parse reads, for every
// kind of column, and refuses a message cut short with an error instead of
// reading past its end.
func TestDecodeInsert(t *testing.T) {
	t.Parallel()
	msg := []byte{'I', 0, 0, 0x40, 0x01, 'N'}
	cols := []struct {
		kind byte
		data []byte
	}{{'t', []byte("org.created")}, {'n', nil}, {'b', []byte{0, 0, 0, 0, 0, 0, 0, 42}}, {'u', nil}, {'t', []byte("")}}
	msg = binary.BigEndian.AppendUint16(msg, uint16(len(cols)))
	for _, c := range cols {
		msg = append(msg, c.kind)
		if c.kind == 't' || c.kind == 'b' {
			msg = binary.BigEndian.AppendUint32(msg, uint32(len(c.data)))
			msg = append(msg, c.data...)
		}
	}
	want, err := pglogrepl.Parse(msg)
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeInsert(msg)
	if err != nil {
		t.Fatal(err)
	}
	w := want.(*pglogrepl.InsertMessage)
	if got.RelationID != w.RelationID || got.Type() != w.Type() || got.Tuple.ColumnNum != w.Tuple.ColumnNum {
		t.Fatalf("got relation %d type %v columns %d, want %d %v %d", got.RelationID, got.Type(), got.Tuple.ColumnNum, w.RelationID, w.Type(), w.Tuple.ColumnNum)
	}
	for i := range w.Tuple.Columns {
		g, e := got.Tuple.Columns[i], w.Tuple.Columns[i]
		if g.DataType != e.DataType || g.Length != e.Length || string(g.Data) != string(e.Data) {
			t.Errorf("column %d: got %+v, want %+v", i, *g, *e)
		}
	}
	for cut := range len(msg) - 1 {
		if _, err := decodeInsert(msg[:cut]); err == nil {
			t.Errorf("a message cut at %d of %d bytes decoded without an error", cut, len(msg))
		}
	}
	bad := append([]byte(nil), msg...)
	bad[8] = 'x'
	if _, err := decodeInsert(bad); err == nil {
		t.Error("a column of kind 'x' decoded without an error")
	}
}
