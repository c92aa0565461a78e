package schema_test

import (
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/schema"
)

// TestParseTableNamesTheByteInTheWholeInput: the byte a refused character
// is at counts from the start of what was passed, not from the start of
// the part after the dot.
func TestParseTableNamesTheByteInTheWholeInput(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"public.Svc_Outbox": `character 'S' at byte 7 `,
		"Svc_outbox":        `character 'S' at byte 0 `,
		"svc_Outbox":        `character 'O' at byte 4 `,
		"app.svc-outbox":    `character '-' at byte 7 `,
		"Public.svc_outbox": `character 'P' at byte 0 `,
		"pub-lic.svc":       `character '-' at byte 3 `,
	} {
		_, err := schema.ParseTable(in)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseTable(%q): %v, want it to say %q", in, err, want)
		}
	}
}
