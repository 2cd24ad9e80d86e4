"""`python -m appliance.pki issue|intercept-ca ...`: see `appliance.pki.main`."""

from appliance.pki import main

raise SystemExit(main())
