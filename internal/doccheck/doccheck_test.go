package doccheck

import (
	"reflect"
	"testing"
)

// TestMakes: a statement is made by its constants in order, whatever the
// words around them; a changed value or a figure inside a longer one is
// not.
func TestMakes(t *testing.T) {
	t.Parallel()
	statement := "A woken relay waits 1 ms (`wakeCoalesce`: more commits land), then after 20 such retries"
	if got, want := Constants(statement), []string{"1 ms", "`wakeCoalesce`", "20"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("Constants = %q, want %q", got, want)
	}
	for doc, want := range map[string]bool{
		"A woken relay waits 1 ms (`wakeCoalesce`: more commits land), then after 20 such retries":  true,
		"After a wake-up the relay waits 1 ms (`wakeCoalesce`) for more commits; 20 retries later":  true,
		"After a wake-up the relay waits 2 ms (`wakeCoalesce`) for more commits; 20 retries later":  false,
		"After a wake-up the relay waits 1 ms (`wakeCoalesce`) for more commits; 200 retries later": false,
		"After a wake-up the relay waits 1 ms (`wakeCoalesce`) for more commits; 2,020 retries":     false,
		"`wakeCoalesce` is 1 ms; 20 retries":                                                        false,
	} {
		if got := Makes(Normalize(doc), statement); got != want {
			t.Errorf("Makes(%q) = %v, want %v", doc, got, want)
		}
	}
	far := "waits 1 ms " + string(make([]byte, window+1)) + "(`wakeCoalesce`) 20"
	if Makes(far, statement) {
		t.Error("constants farther apart than the window made the statement")
	}
	if got := Constants("(`MaxInFlightDefault`, 4,096)"); !reflect.DeepEqual(got, []string{"`MaxInFlightDefault`", "4,096"}) {
		t.Errorf("Constants = %q", got)
	}
}
