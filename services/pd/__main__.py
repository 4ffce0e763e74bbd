from services.pd.service import main

main()
